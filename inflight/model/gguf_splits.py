"""How llama.cpp splits text before byte-level BPE, per `tokenizer.ggml.pre` type, where
transformers' GGUF reader has no split for the type (its `GGUF_PRE_TOKENIZER_SPLITS`).

A GGUF file carries a tokenizer's vocabulary and merges but not its pre-tokenizer; llama.cpp's
converter names it instead, by a hash of the Hugging Face tokenizer's output, and llama.cpp splits
text by a list of expressions per name (`llama-vocab.cpp`, `llm_tokenizer_bpe`), each applied to
the pieces the one before left, matches and gaps both kept: what `tokenizers`' `Split(...,
"isolated")` does. The expressions are the models' own (their tokenizer.json's), where llama.cpp
did not have to rewrite them for its regex engine."""

from __future__ import annotations

# GPT-2's expression, without its last `|\s+` (a gap is a piece of its own anyway).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CJK = "[一-龥ࠀ-一가-\ud7ff]+"
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_DEEPSEEK3 = [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
# DeepSeek LLM's letters (its tokenizer.json's class, Latin, Greek, Cyrillic... and their kin).
_DEEPSEEK_LETTERS = ("A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-"
                     "ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-"
                     "ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃")
_STARCODER = [r"\p{N}", _GPT2]  # digits one by one
_BLOOM = [r" ?[^(\s|.,!?…。，、।۔،)]+"]

PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"],
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"],
                    _STARCODER),
    "deepseek-llm": ["[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
                     r"\s+$", _CJK, r"\p{N}+"],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], _DEEPSEEK3),
    **dict.fromkeys(["stablelm2", "hunyuan", "solar-open", "grok-2"], [_QWEN2]),
    "seed-coder": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "minicpm5": [r"\p{N}{1,3}", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    **dict.fromkeys(["bloom", "poro-chat", "gpt3-finnish"], _BLOOM),
    "viking": [*_BLOOM, r"\p{N}"],
}

# llama.cpp's own forms of the types below (its `llama-vocab.cpp`, the models' case-insensitive
# suffixes spelled out), as it writes them
_LLAMA_CPP_FORMS: dict[tuple[str, ...], list[str]] = {
    ('youtu',): [
        '[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+',
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]"
        "|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p"
        "{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
        '\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ],
    ('tiny_aya', 'cohere2moe'): [
        '\\d{1,3}(?=(?:\\d{3})*\\b)',
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]"
        "|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p"
        "{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
        '\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ],
    ('bailingmoe', 'bailingmoe2', 'llada-moe'): [
        "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}"
        ']+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+',
    ],
    ('exaone-moe',): [
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*"
        '(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+',
    ],
    ('laguna',): [
        '[^\\n]+|[\\n]+',
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
        '?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ],
    ('jais-2',): [
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1"
        ',3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}('
        '?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}',
    ],
    ('spark2_5',): [
        '\\p{N}{1,3}',
        '[一-龥\u3040-ゟ゠-ヿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P'
        '}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+',
        '\\p{N}',
    ],
    ('ufakzeka',): [
        '[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    ],
}
PRE_TOKENIZER_SPLITS.update({name: exprs for names, exprs in _LLAMA_CPP_FORMS.items() for name in names})

# Types split by GPT-2's expression, which transformers' byte-level BPE applies when it knows no
# other (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_GPT2` and the types it treats alike).
GPT2_SPLIT = frozenset({"gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
                        "roberta-bpe", "jina-es", "jina-de", "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code",
                        "gigachat", "a.x-4.0", "mellum", "modern-bert"})
# Types whose split is one transformers has under another name (GLM's is Llama 3's).
SPLIT_AS = {"glm4": "llama-bpe", "glm5": "llama-bpe", "chatglm-bpe": "llama-bpe"}


def splits_for(pre: str | None, known: dict[str, str]) -> list[str] | None:
    """The expressions to split a byte-level vocabulary's text by, for pre-tokenizer type `pre`
    (None: transformers' own split is right: a type in `known`, transformers' splits, GPT-2's,
    or no type at all, as in files of converters older than the field). ValueError for a type
    neither knows (llama.cpp refuses those too), or one llama.cpp splits by code of its own."""
    if pre is None or pre in known or pre in GPT2_SPLIT:
        return None
    if pre in SPLIT_AS:
        return [known[SPLIT_AS[pre]]]
    if pre in PRE_TOKENIZER_SPLITS:
        return PRE_TOKENIZER_SPLITS[pre]
    raise ValueError(f"its pre-tokenizer type {pre!r} is not one inflight knows how to split text by")
