"""The loss step inside TRL's GRPOTrainer on CPU: the stock trainer vs fastpo.integrations.trl.FastPOGRPOTrainer.

Both sides are the same trainer class family on the same model and the same batch; the only difference is the
code under ``compute_loss``: TRL 1.16's fused LM head (chunked logprob tiles of 4,096 tokens x 32,768 vocab
columns, every position of the sequence on CPU) and its torch loss, against fastpo's fused linear logprob (64 MiB
token x 4,096-column blocks, completion positions only) and the fastpo::ppo_loss op. The loss step is
``trainer.compute_loss(model, batch)`` + ``backward()`` on one synthetic GRPO batch (prompt + completion ids,
masks, advantages, old logprobs), i.e. what ``training_step`` runs after generation; the optimiser step is the same
on both sides and left out.

Each side runs in a fresh subprocess (memory accounting starts clean): it builds the trainer, then runs the loss
step ``1 + repeats`` times. Peak memory = the process's peak RSS (VmHWM, reset just before the first step) minus
its RSS before that step: what the loss step adds on top of model, optimizer-less trainer and batch. steps/s =
1 / wall time of each later step (p50, p20, p80 over the repeats).

Default shapes: a Qwen2.5-0.5B-like head (hidden 896, vocab 151,936, tied embeddings) on a 1-layer backbone, 8
completions of 512 tokens after 32-token prompts (4,096 scored tokens), beta 0, loss_type dapo, fp32.

    python bench/bench_integrations.py                    # rows -> bench/results/integrations.csv
    python bench/bench_integrations.py --smoke --no-csv   # tiny shapes: proves the script runs

Target (issue): fastpo's peak <= 0.3x the stock path's at equal steps/s or better. Needs trl 1.16 (``make test``
installs it with the test peers, ``make bench-vs-trl`` too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_allow_dirty,
    append_rows,
    pin_threads,
    print_table,
    quantiles,
    require_clean_tree,
    status_kib,
)

PROVIDERS = ("trl", "fastpo")


def build_model(path: Path, hidden: int, vocab: int, layers: int, seed: int = 0) -> None:
    """A Qwen2 model with a real-size vocabulary (tied embeddings, as Qwen2.5-0.5B) and the tiny tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastpo.testing import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path, vocab_size=512)
    heads = max(1, hidden // 64)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=max(64, hidden * 4 // 3),
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1 if heads % 2 else 2,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None, dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        Qwen2ForCausalLM(config).save_pretrained(str(path))


def child(spec: dict) -> dict:
    """One provider in this (fresh) process: build the trainer, run the loss step, report memory and step times."""
    import datasets
    import torch
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from fastpo.integrations.trl import FastPOGRPOTrainer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    n, p_len, c_len = spec["completions"], spec["prompt_len"], spec["completion_len"]
    args = GRPOConfig(output_dir=spec["out"], per_device_train_batch_size=n, num_generations=2,
                      max_completion_length=c_len, beta=0.0, loss_type="dapo", use_cpu=True, bf16=False,
                      report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
                      model_init_kwargs={"dtype": "float32"})
    cls = FastPOGRPOTrainer if spec["provider"] == "fastpo" else GRPOTrainer
    data = datasets.Dataset.from_dict({"prompt": ["a"] * n})
    trainer = cls(model=spec["model"], reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                  train_dataset=data, processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model
    model.train()
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    completion_mask = (torch.arange(c_len)[None] < torch.randint(c_len // 2, c_len + 1, (n, 1), generator=g)).long()
    batch = dict(prompt_ids=torch.randint(0, vocab, (n, p_len), generator=g),
                 prompt_mask=torch.ones(n, p_len, dtype=torch.long),
                 completion_ids=torch.randint(0, vocab, (n, c_len), generator=g), completion_mask=completion_mask,
                 advantages=torch.randn(n, generator=g), old_per_token_logps=-5 - torch.rand(n, c_len, generator=g),
                 num_items_in_batch=completion_mask.sum())

    def step():
        model.zero_grad(set_to_none=True)
        trainer.compute_loss(model, batch).backward()

    model.zero_grad(set_to_none=True)
    base = status_kib("VmRSS") * 1024
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    peak = status_kib("VmHWM") * 1024
    times = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return dict(provider=spec["provider"], peak_extra_mib=(peak - base) / 2**20, first_s=first, step_s=times,
                scored_tokens=int(completion_mask.sum()))


def run_side(spec: dict, timeout: int) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    if out.returncode != 0:
        raise RuntimeError(f"{spec['provider']} side failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--completions", type=int, default=8, help="completions in the batch (even)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--completion-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="timed loss steps per side (after the first)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per side")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (hidden 64, vocab 4096, 2 x 16 tokens)")
    ap.add_argument("--no-csv", action="store_true", help="print only; write no rows")
    ap.add_argument("--results-dir", default=None, help="where integrations.csv goes (default bench/results)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        pin_threads(spec["threads"])
        print(json.dumps(child(spec)))
        return
    if not args.no_csv:
        require_clean_tree(args.allow_dirty)
    if args.smoke:
        args.hidden, args.vocab, args.completions, args.prompt_len, args.completion_len, args.repeats = (
            64, 4096, 2, 8, 16, 1)
    pin_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-integrations-") as work:
        model_dir = Path(work) / "model"
        build_model(model_dir, args.hidden, args.vocab, args.layers)
        results = {}
        for provider in PROVIDERS:
            spec = dict(provider=provider, model=str(model_dir), out=str(Path(work) / provider),
                        completions=args.completions, prompt_len=args.prompt_len, completion_len=args.completion_len,
                        repeats=args.repeats, threads=args.threads)
            results[provider] = run_side(spec, args.timeout)
            r = results[provider]
            print(f"{provider}: peak +{r['peak_extra_mib']:.0f} MiB, first step {r['first_s']:.2f} s, steps "
                  f"{', '.join(f'{t:.2f}' for t in r['step_s'])} s", flush=True)
    import trl

    tokens = results["fastpo"]["scored_tokens"]
    config = (f"H={args.hidden} V={args.vocab} layers={args.layers} tied B={args.completions} prompt={args.prompt_len} "
              f"completion={args.completion_len} ({tokens} scored tokens) beta=0 dapo fp32 threads={args.threads} "
              f"trl={trl.__version__}; peak = VmHWM - RSS before the first loss step, fresh subprocess per side")
    rows = []
    for provider, r in results.items():
        rate = quantiles([1.0 / t for t in r["step_s"]])
        mem = r["peak_extra_mib"]
        common = dict(name="trl_grpo_loss_step", provider=provider, mode="full", x_name="tokens", x_value=tokens,
                      config=config)
        rows.append(dict(common, metric="steps_per_s", unit="1/s", p50=rate[0], p20=rate[1], p80=rate[2]))
        rows.append(dict(common, metric="peak_extra_rss", unit="MiB", p50=mem, p20=mem, p80=mem))
    print_table(rows)
    mem_ratio = results["fastpo"]["peak_extra_mib"] / max(results["trl"]["peak_extra_mib"], 1e-9)
    speed = quantiles(results["trl"]["step_s"])[0] / quantiles(results["fastpo"]["step_s"])[0]
    met = mem_ratio <= 0.3 and speed >= 1.0
    print(f"fastpo / stock: peak memory {mem_ratio:.3f}x, steps/s {speed:.3f}x (target <= 0.3x at >= 1x: "
          f"{'met' if met else 'not met'})")
    if not args.no_csv:
        print(f"appended {len(rows)} rows to {append_rows('integrations', rows, args.results_dir)}")


if __name__ == "__main__":
    main()
