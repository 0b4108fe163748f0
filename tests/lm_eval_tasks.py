"""Two lm-evaluation-harness tasks on local data (no dataset download): a multiple-choice
(log-likelihood) task and a ``generate_until`` task. ``write_tasks(dir)`` writes their
JSONL data and task YAMLs; pass the dir as ``--include_path`` (CLI) or
``TaskManager(include_path=...)``. Used by tests/test_scoring_serving.py and
benchmarks/lm_eval_scoring.py."""

from __future__ import annotations

import json
import os

MC_TASK, GEN_TASK = "jaxinfer_mc", "jaxinfer_gen"

MC = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("Which planet is known as the red planet?", ["Venus", "Jupiter", "Mars", "Saturn"], 2),
    ("What is the boiling point of water at sea level in Celsius?", ["50", "90", "150", "100"], 3),
    ("Which animal is the largest mammal?", ["blue whale", "elephant", "giraffe", "hippo"], 0),
    ("What color do you get by mixing blue and yellow?", ["purple", "green", "orange", "red"], 1),
    ("How many days are in a leap year?", ["365", "364", "366", "360"], 2),
    ("Which gas do plants absorb from the air?", ["oxygen", "nitrogen", "helium", "carbon dioxide"], 3),
    ("What is the opposite of hot?", ["cold", "warm", "big", "fast"], 0),
    ("Which language is spoken in Brazil?", ["Spanish", "Portuguese", "French", "Italian"], 1),
    ("What is 7 times 8?", ["54", "64", "56", "48"], 2),
    ("Who wrote Romeo and Juliet?", ["Dickens", "Tolstoy", "Homer", "Shakespeare"], 3),
]

GEN = [
    ("The capital of Italy is", "Rome"), ("The capital of Japan is", "Tokyo"),
    ("The opposite of up is", "down"), ("Two plus two equals", "four"),
    ("The color of the sky on a clear day is", "blue"), ("The first month of the year is", "January"),
    ("Water freezes at zero degrees", "Celsius"), ("The largest ocean on Earth is the", "Pacific"),
]

_MC_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

_GEN_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: {max_gen}
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    regexes_to_ignore: ["\\\\s"]
"""


def write_tasks(out_dir: str, max_gen_toks: int = 8) -> str:
    os.makedirs(out_dir, exist_ok=True)
    mc, gen = os.path.join(out_dir, "mc.jsonl"), os.path.join(out_dir, "gen.jsonl")
    with open(mc, "w") as f:
        for q, choices, a in MC:
            f.write(json.dumps({"question": q, "choices": choices, "answer": a}) + "\n")
    with open(gen, "w") as f:
        for p, a in GEN:
            f.write(json.dumps({"prompt": p, "answer": a}) + "\n")
    with open(os.path.join(out_dir, f"{MC_TASK}.yaml"), "w") as f:
        f.write(_MC_YAML.format(task=MC_TASK, data=json.dumps(mc)))
    with open(os.path.join(out_dir, f"{GEN_TASK}.yaml"), "w") as f:
        f.write(_GEN_YAML.format(task=GEN_TASK, data=json.dumps(gen), max_gen=max_gen_toks))
    return out_dir


def per_example(results: dict, task: str) -> list[tuple]:
    """(doc id, [per-choice log-likelihoods] or the generated text, the example's metric)
    from ``simple_evaluate(..., log_samples=True)`` results, in doc order."""
    out = []
    for s in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        resp = [r[0] for r in s["resps"]]
        metric = s.get("acc", s.get("exact_match"))
        out.append((s["doc_id"], [r[0] if isinstance(r, (list, tuple)) else r for r in resp], metric))
    return out
