"""Writes task.jsonl beside this file: a 40-item multiple-choice task for lm-evaluation-harness
built from local data only (20 hand-written questions, 20 sentence completions cut from the
public-domain prose in inflight/data/, each true continuation against three from elsewhere in
the same text). The task file is committed; this is how it was made (seed 1234).

    .venv/bin/python benchmarks/lm_eval/make_task.py
"""

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
rng = random.Random(1234)
items = []
# 20 hand-written factual / arithmetic questions (gold index varies)
qa = [
 ("What is 2 + 3?", ["5","6","4","7"]),
 ("What is 10 minus 4?", ["6","4","14","5"]),
 ("What is 3 times 4?", ["12","7","9","15"]),
 ("What is 100 divided by 10?", ["10","1","20","1000"]),
 ("What is the capital of France?", ["Paris","Berlin","Madrid","Rome"]),
 ("What is the capital of Japan?", ["Tokyo","Beijing","Seoul","Bangkok"]),
 ("What is the capital of Italy?", ["Rome","Paris","Vienna","Lisbon"]),
 ("How many days are in a week?", ["seven","five","ten","twelve"]),
 ("How many legs does a spider have?", ["eight","six","four","ten"]),
 ("What color is the sky on a clear day?", ["blue","green","red","purple"]),
 ("What do bees make?", ["honey","milk","silk","wool"]),
 ("Which planet do we live on?", ["Earth","Mars","Venus","Jupiter"]),
 ("What is frozen water called?", ["ice","steam","sand","glass"]),
 ("Which animal says 'moo'?", ["a cow","a dog","a cat","a duck"]),
 ("How many months are in a year?", ["twelve","ten","six","fifteen"]),
 ("What is the opposite of hot?", ["cold","warm","wet","loud"]),
 ("Which is the largest ocean on Earth?", ["the Pacific","the Atlantic","the Indian","the Arctic"]),
 ("Who wrote the play Romeo and Juliet?", ["William Shakespeare","Charles Dickens","Jane Austen","Mark Twain"]),
 ("What gas do humans need to breathe?", ["oxygen","helium","neon","argon"]),
 ("What is the boiling point of water in degrees Celsius at sea level?", ["100","50","0","212"]),
]
for q, ch in qa:
    gold_text = ch[0]
    ch = ch[:]
    rng.shuffle(ch)
    items.append({"kind": "qa", "query": f"Question: {q}\nAnswer:", "choices": ch, "gold": ch.index(gold_text)})
# 20 sentence completions cut from the local corpora (true continuation + 3 distractors from same file)
files = sorted(str(f) for f in (HERE.parents[1] / "inflight" / "data").glob("corpus-*.txt"))
per_file = {f: [] for f in files}
for f in files:
    text = re.sub(r"\s+", " ", open(f).read())
    sents = re.split(r"(?<=[.!?])\s+", text)
    for s in sents:
        w = s.split()
        if 18 <= len(w) <= 60 and '"' not in s:
            per_file[f].append(w)
for i in range(20):
    f = files[i % len(files)]
    pool = per_file[f]
    w = rng.choice(pool)
    ctx, cont = " ".join(w[:12]), " ".join(w[12:20])
    distr = []
    while len(distr) < 3:
        o = rng.choice(pool)
        c = " ".join(o[12:20])
        if o is not w and c != cont and c not in distr:
            distr.append(c)
    ch = [cont, *distr]
    rng.shuffle(ch)
    items.append({"kind": "completion", "query": ctx, "choices": ch, "gold": ch.index(cont)})
with open(HERE / "task.jsonl", "w") as fh:
    for it in items:
        fh.write(json.dumps(it) + "\n")
print(len(items), "items; gold distribution", [sum(1 for it in items if it["gold"] == k) for k in range(4)])
