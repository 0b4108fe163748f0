"""lm-evaluation-harness against ``jaxinfer serve`` on the default model, checked against HF
transformers on the same data (issue 21's acceptance): the two local tasks of
tests/lm_eval_tasks.py (multiple choice by log-likelihood, and ``generate_until``) run
with lm_eval's ``local-completions`` backend through the server, and with its ``hf``
backend on the default model's weights in float32 (read by transformers' GGUF reader, as
tests/test_default_model.py does). Reports the largest per-example log-likelihood
difference, whether every generation is the same, and both accuracies.

    python benchmarks/lm_eval_scoring.py [--url http://127.0.0.1:8000] [--out lm_eval.json]

Without ``--url`` it starts ``jaxinfer serve --enable-prompt-logprobs`` on a free port
and stops it at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from common import REPO, base_parser, load_avg, machine  # noqa: E402
from lm_eval_tasks import GEN_TASK, MC_TASK, per_example, write_tasks  # noqa: E402


@contextlib.contextmanager
def served(url: str | None):
    """The server's base URL: ``url``, or a ``jaxinfer serve`` started here."""
    if url:
        yield url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", "--port", str(port),
                             "--enable-prompt-logprobs", "--max-model-len", "1024"], cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 1800
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        yield base
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running `jaxinfer serve --enable-prompt-logprobs`")
    args = p.parse_args()

    import lm_eval
    import numpy as np
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from jaxinfer.loading import load_tokenizer
    from test_default_model import hf_default_model

    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="jaxinfer-lm-eval-")
    tok = load_tokenizer(None)
    tok.hf.save_pretrained(os.path.join(tmp, "tokenizer"))
    common = dict(tasks=[MC_TASK, GEN_TASK], task_manager=TaskManager(include_path=write_tasks(os.path.join(tmp, "tasks"))),
                  log_samples=True, batch_size=1)
    with served(args.url) as base:
        with urllib.request.urlopen(base + "/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
        t1 = time.time()
        ours = lm_eval.simple_evaluate(model="local-completions", model_args=dict(
            model=model, base_url=base + "/v1/completions", tokenizer=os.path.join(tmp, "tokenizer"),
            tokenizer_backend="huggingface", max_length=1024, num_concurrent=1, max_retries=1), **common)
        served_s = time.time() - t1
    t2 = time.time()
    hf = lm_eval.simple_evaluate(model=HFLM(pretrained=hf_default_model(), tokenizer=tok.hf, batch_size=1),
                                 **common)
    report = {"command": " ".join(sys.argv), "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t0)),
              "loadavg": load_avg(), "machine": machine(), "served_seconds": round(served_s, 1),
              "hf_seconds": round(time.time() - t2, 1)}
    for task, metric in ((MC_TASK, "acc,none"), (GEN_TASK, "exact_match,none")):
        a, b = per_example(ours, task), per_example(hf, task)
        entry = {"examples": len(a), "jaxinfer": ours["results"][task][metric], "hf": hf["results"][task][metric],
                 "same_per_example_metric": [x[2] for x in a] == [x[2] for x in b]}
        if task == MC_TASK:
            entry["max_abs_loglik_diff"] = float(max(np.abs(np.subtract(x[1], y[1])).max() for x, y in zip(a, b)))
        else:
            entry["same_generations"] = [x[1] for x in a] == [y[1] for y in b]
            entry["generations"] = [x[1][0] for x in a]
        report[task] = entry
    mc, gen = report[MC_TASK], report[GEN_TASK]
    report["holds"] = (mc["max_abs_loglik_diff"] <= 1e-3 and mc["jaxinfer"] == mc["hf"] and gen["same_generations"]
                       and gen["jaxinfer"] == gen["hf"] and mc["same_per_example_metric"])
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
