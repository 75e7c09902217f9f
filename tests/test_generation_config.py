"""A model's own generation settings, as vLLM and llama.cpp apply them: the tokens that end its
turns (a checkpoint's generation_config.json; a GGUF file's EOS, EOT and EOM and the tokens
llama.cpp ends at by their text) and the sampling defaults its authors ship (generation_config.json,
a GGUF file's general.sampling.* keys), used where a request leaves a setting unset."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from test_loading import TINY, save_word_tokenizer, tiny_hf_model, write_tiny_gguf

from inflight import LLM, EngineConfig, LLMEngine, SamplingParams
from inflight.errors import ConfigError, ModelLoadError
from inflight.model.loader import gguf_end_tokens, load_model_config, resolve_model
from inflight.request import FinishReason
from inflight.server.config import ServerConfig
from inflight.server.launcher import serve_in_thread

PROMPT = [7, 19, 40, 41, 42, 100, 3, 77]


def tiny_checkpoint(path: Path, generation: dict[str, object] | None) -> Path:
    """A small random qwen3 checkpoint with a word tokenizer (its EOS <|im_end|>) and, unless None,
    `generation` as its generation_config.json (as transformers reads it too)."""
    model = tiny_hf_model("qwen3")
    model.generation_config.eos_token_id = None
    model.save_pretrained(path, safe_serialization=True)
    save_word_tokenizer(path, TINY["vocab"])
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    else:
        (path / "generation_config.json").unlink()
    return path


def test_the_generation_configs_eos_ends_the_output_where_transformers_generate_stops(tmp_path):
    """Llama 3's instruct models end a turn with <|eot_id|>, which only their generation_config.json
    names (config.json says <|end_of_text|>): a token listed there ends the output, as in
    transformers' `generate` on the same directory."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(tmp_path, None)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    free = LLM(model=str(path), num_kv_blocks=32).generate([PROMPT], greedy)[0]
    tokens = free.token_ids
    # The first token, from the third on, not seen before in the output: the new end of the turn.
    stop_at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[stop_at]]}))

    llm = LLM(model=str(path), num_kv_blocks=32)
    assert tokens[stop_at] in llm.engine.tokenizer.eos_token_ids
    out = llm.generate([PROMPT], greedy)[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == tokens[:stop_at + 1]
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)[0, len(PROMPT):]
    assert out.token_ids == expected.tolist()


@pytest.mark.parametrize(("vocab", "eos", "turn_end"), [
    ("llama-bpe", (128001, "<|end_of_text|>"), (128009, "<|eot_id|>")),  # Llama 3
    ("phi-3", (32000, "<|endoftext|>"), (32007, "<|end|>")),
    ("qwen2", (151643, "<|endoftext|>"), (151645, "<|im_end|>")),  # ChatML
])
def test_a_gguf_file_ends_a_turn_where_llama_cpp_does(vocab_reader, vocab, eos, turn_end):
    """llama.cpp's own vocabulary files name only the EOS of pretraining; a chat ends at the
    token its template closes a turn with, which llama.cpp finds by its text. So does inflight."""
    reader = vocab_reader(vocab)
    texts = reader.fields["tokenizer.ggml.tokens"]
    ends = gguf_end_tokens(reader)
    assert ends[0] == eos[0]  # the file's EOS first
    for token_id, text in (eos, turn_end):
        assert token_id in ends and bytes(texts.parts[texts.data[token_id]]).decode() == text
    words = {bytes(texts.parts[texts.data[i]]).decode() for i in ends}
    assert not words & {"<|im_start|>", "<|begin_of_text|>", "<s>", "the", "Hello"}
    if vocab == "qwen2":  # its `</s>` is a BPE merge (typed normal), where llama.cpp stops too
        assert texts.parts[texts.data[128247]].tobytes() == b"</s>" and 128247 not in ends


def test_a_gguf_files_end_tokens_and_sampling_defaults_are_read(tmp_path):
    """A file naming its EOT and EOM beside its EOS, with a turn-end token it does not name and
    llama.cpp's general.sampling.* keys: every end token ends a generation, and the sampling
    keys SamplingParams has become the model's defaults."""
    words = [f"w{i}" for i in range(TINY["vocab"])]
    words[5], words[9], words[11], words[12] = "<end_of_turn>", "<|im_start|>", "<|eot_id|>", "<|eom_id|>"

    def metadata(w) -> None:
        w.add_token_list(words)
        w.add_eos_token_id(2)
        w.add_uint32("tokenizer.ggml.eot_token_id", 11)
        w.add_uint32("tokenizer.ggml.eom_token_id", 12)
        w.add_float32("general.sampling.temp", 0.7)
        w.add_int32("general.sampling.top_k", 20)
        w.add_float32("general.sampling.top_p", 0.8)

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, {}, metadata=metadata)
    config = load_model_config(resolve_model(str(path)))
    assert config.eos_token_ids == (2, 11, 12, 5)
    assert config.sampling_defaults == pytest.approx({"temperature": 0.7, "top_k": 20, "top_p": 0.8})


def test_the_models_sampling_defaults_stand_for_what_a_request_leaves_unset(tmp_path):
    """generation_config.json's sampling settings are the defaults of the offline API and the
    server (vLLM's `--generation-config auto`): with its top_k of 1 every sample of a request that
    sets no top_k is the greedy one, and its max_new_tokens caps a request without max_tokens;
    a request's own setting wins (vLLM's top_k -1: off); `generation_config="vllm"` leaves them out."""
    path = tiny_checkpoint(tmp_path, {"top_k": 1, "temperature": 1.3, "max_new_tokens": 6})
    plain = LLM(model=str(path), num_kv_blocks=64, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    greedy = plain.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids

    engine = LLMEngine(EngineConfig.from_kwargs(str(path), num_kv_blocks=64, max_batch_size=8))
    assert engine.default_sampling == {"top_k": 1, "temperature": 1.3, "max_tokens": 6}
    offline = LLM(model=str(path), num_kv_blocks=64)
    assert offline.get_default_sampling_params() == SamplingParams(top_k=1, temperature=1.3, max_tokens=6)
    out = offline.generate([PROMPT])[0]
    assert len(out.token_ids) <= 6 and out.token_ids == greedy[:len(out.token_ids)]

    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as running:
        def samples(**extra: object) -> list[list[str]]:
            body = {"model": engine.model_name, "prompt": PROMPT, "n": 4, "logprobs": 0, "ignore_eos": True, **extra}
            r = httpx.post(running.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return [c["logprobs"]["tokens"] for c in r.json()["choices"]]

        defaulted = samples()
        assert all(len(s) == 6 for s in defaulted)  # max_new_tokens
        assert len({tuple(s) for s in defaulted}) == 1  # top_k 1: the greedy tokens, every sample
        assert [engine.tokenizer.hf.convert_tokens_to_ids(t) for t in defaulted[0]] == greedy
        assert len({tuple(s) for s in samples(top_k=-1, max_tokens=12)}) > 1  # the request's own


def test_a_generation_config_that_cannot_be_used_is_one_clear_error(tmp_path):
    """A default SamplingParams refuses stops the start, naming the way around it; an end token
    that is not an id names the file and the key."""
    path = tiny_checkpoint(tmp_path, {"temperature": -1})
    with pytest.raises(ConfigError, match="the model's sampling defaults .*temperature.*--generation-config vllm"):
        LLM(model=str(path), num_kv_blocks=16)
    plain = LLM(model=str(path), num_kv_blocks=16, generation_config="vllm")
    assert plain.get_default_sampling_params().temperature == 1
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    with pytest.raises(ModelLoadError, match="generation_config.json: eos_token_id must be a token id"):
        LLM(model=str(path), num_kv_blocks=16)
    with pytest.raises(ConfigError, match="generation_config must be one of auto, vllm"):
        EngineConfig.from_kwargs(str(path), generation_config="model")
