"""The loss step inside TRL's GRPOTrainer on CPU: the stock trainer vs fastpo.integrations.trl.FastPOGRPOTrainer.

Both sides are the same trainer class family on the same model and the same batch; the only difference is the
code under ``compute_loss``: TRL 1.16's fused LM head (chunked logprob tiles of 4,096 tokens x 32,768 vocab
columns, every position of the sequence on CPU) and its torch loss, against fastpo's fused linear logprob (64 MiB
token x 4,096-column blocks, completion positions only) and the fastpo::ppo_loss op. The loss step is
``trainer.compute_loss(model, batch)`` + ``backward()`` on one synthetic GRPO batch (prompt + completion ids,
masks, advantages, old logprobs), i.e. what ``training_step`` runs after generation; the optimiser step is the same
on both sides and left out.

Each side runs in a fresh subprocess (memory accounting starts clean): it builds the trainer, reads every weight
once, then runs the loss step ``1 + repeats`` times. Peak memory = the process's peak RSS (VmHWM, reset just before
the first step) minus its RSS before that step: what the loss step adds on top of model, optimizer-less trainer and
batch. The weights are read first because the trainer loads them memory-mapped from the safetensors file: their
pages become resident when first touched, and without that read the first step's peak would count the model's own
weights (547 MiB at the default shapes, on every side). The row also records the file-backed RSS the measured step
paged in (``paged_in`` in its config; about 0 when the read did its job). steps/s = 1 / wall time of each later
step (p50, p20, p80 over the repeats). With ``--device cuda`` the peak is torch's peak allocated CUDA memory
minus the allocated memory before the step.

``--liger`` adds a third side, ``liger``: the stock trainer whose loss step is Liger's fused linear GRPO loss
(``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss``) on the decoder's last hidden states, as TRL's
``use_liger_loss=True`` did before TRL 1.16 dropped that option. It needs liger_kernel; without it the script
stops with one line.

Default shapes: a Qwen2.5-0.5B-like head (hidden 896, vocab 151,936, tied embeddings) on a 1-layer backbone, 8
completions of 256 to 512 tokens (random lengths, 2,727 scored tokens in all) after 32-token prompts, beta 0,
loss_type dapo, fp32.

    python bench/bench_integrations.py                    # rows -> bench/results/integrations.csv
    python bench/bench_integrations.py --smoke --no-csv   # tiny shapes: proves the script runs
    python bench/bench_integrations.py --device cuda --liger --results-dir OUT   # GPU: stock, fastpo, Liger

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
LIGER = "liger"  # the --liger side
DEVICES = ("cpu", "cuda")


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


def liger_loss_class() -> type:
    """Liger's ``LigerFusedLinearGRPOLoss``; SystemExit with one line when liger_kernel is not importable."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as exc:
        raise SystemExit(f"--liger needs liger_kernel importable (pip install liger-kernel), got: {exc}") from None
    return LigerFusedLinearGRPOLoss


def check_device(device: str) -> None:
    """SystemExit with one line unless ``device`` is one of :data:`DEVICES` and usable here."""
    if device not in DEVICES:
        raise SystemExit(f"--device must be one of {DEVICES}, got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")


def liger_trainer_class(loss_cls: type) -> type:
    """A GRPOTrainer whose loss step is ``loss_cls`` (Liger's ``LigerFusedLinearGRPOLoss`` interface) on the last
    hidden states of the completion positions and the lm-head weight: TRL's ``use_liger_loss=True`` loss step of
    the releases that had the option (TRL 1.16 has none). Generation, advantages etc. stay TRL 1.16's."""
    import torch
    from trl import GRPOTrainer

    class LigerLossGRPOTrainer(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            a = self.args
            self.liger_grpo_loss = loss_cls(beta=a.beta, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                                            loss_type=a.loss_type, temperature=self.temperature,
                                            max_completion_length=a.max_completion_length, use_ref_model=a.beta != 0)

        def _compute_loss(self, model, inputs):
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
            unwrapped = self.accelerator.unwrap_model(model)
            hidden = unwrapped.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                          use_cache=False).last_hidden_state
            hidden = hidden[:, :-1][:, -completion_ids.size(1):]  # the states that predict the completion tokens
            head = unwrapped.get_output_embeddings()
            loss, _ = self.liger_grpo_loss(hidden, head.weight, completion_ids, completion_mask, inputs["advantages"],
                                           head.bias, inputs.get("ref_per_token_logps"),
                                           inputs.get("old_per_token_logps"))
            return loss

    return LigerLossGRPOTrainer


def make_trainer(spec: dict, loss_cls: type | None = None):
    """The spec's provider's trainer on the spec's model: ``trl`` (stock GRPOTrainer), ``fastpo``
    (FastPOGRPOTrainer) or ``liger`` (:func:`liger_trainer_class` of ``loss_cls``, Liger's loss by default)."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from fastpo.integrations.trl import FastPOGRPOTrainer

    tok = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    n = spec["completions"]
    args = GRPOConfig(output_dir=spec["out"], per_device_train_batch_size=n, num_generations=2,
                      max_completion_length=spec["completion_len"], beta=0.0, loss_type="dapo",
                      use_cpu=spec.get("device", "cpu") == "cpu", bf16=False, report_to="none", save_strategy="no",
                      disable_tqdm=True, seed=0, model_init_kwargs={"dtype": "float32"})
    if spec["provider"] == LIGER:
        cls = liger_trainer_class(loss_cls or liger_loss_class())
    else:
        cls = FastPOGRPOTrainer if spec["provider"] == "fastpo" else GRPOTrainer
    data = datasets.Dataset.from_dict({"prompt": ["a"] * n})
    trainer = cls(model=spec["model"], reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                  train_dataset=data, processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def make_batch(spec: dict, vocab: int, device) -> dict:
    """One synthetic GRPO batch (what generation hands to the loss step), the same for every provider: random
    prompt and completion ids, completions of random length in [T / 2, T], advantages, old logprobs."""
    import torch

    g = torch.Generator().manual_seed(1)
    n, p_len, c_len = spec["completions"], spec["prompt_len"], spec["completion_len"]
    completion_mask = (torch.arange(c_len)[None] < torch.randint(c_len // 2, c_len + 1, (n, 1), generator=g)).long()
    batch = dict(prompt_ids=torch.randint(0, vocab, (n, p_len), generator=g),
                 prompt_mask=torch.ones(n, p_len, dtype=torch.long),
                 completion_ids=torch.randint(0, vocab, (n, c_len), generator=g), completion_mask=completion_mask,
                 advantages=torch.randn(n, generator=g), old_per_token_logps=-5 - torch.rand(n, c_len, generator=g),
                 num_items_in_batch=completion_mask.sum())
    return {k: v.to(device) for k, v in batch.items()}


def child(spec: dict) -> dict:
    """One provider in this (fresh) process: build the trainer, run the loss step, report memory and step times."""
    import torch

    torch.manual_seed(0)
    trainer = make_trainer(spec)
    model = trainer.model
    device = next(model.parameters()).device
    batch = make_batch(spec, model.config.vocab_size, device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        model.zero_grad(set_to_none=True)
        trainer.compute_loss(model, batch).backward()
        sync()

    model.zero_grad(set_to_none=True)
    with torch.no_grad():  # page in the memory-mapped weights now, so that the base RSS holds them (docstring)
        for t in (*model.parameters(), *model.buffers()):
            t.sum()
    sync()
    base = torch.cuda.memory_allocated() if cuda else status_kib("VmRSS") * 1024
    file_base = status_kib("RssFile") * 1024
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else status_kib("VmHWM") * 1024
    paged_in = status_kib("RssFile") * 1024 - file_base
    times = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return dict(provider=spec["provider"], peak_extra_mib=(peak - base) / 2**20, paged_in_mib=paged_in / 2**20,
                first_s=first, step_s=times, scored_tokens=int(batch["completion_mask"].sum()))


def run_side(spec: dict, timeout: int) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    if out.returncode != 0:
        raise RuntimeError(f"{spec['provider']} side failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(results: dict[str, dict], config: str) -> tuple[list[dict], dict[str, float]]:
    """Rows (steps/s and peak memory per provider) and each other provider's ratios to the stock ``trl`` side:
    ``{provider}_peak_ratio`` (its peak / stock peak) and ``{provider}_speedup`` (stock p50 step time / its)."""
    rows = []
    tokens = results["trl"]["scored_tokens"]
    for provider, r in results.items():
        rate = quantiles([1.0 / t for t in r["step_s"]])
        mem = r["peak_extra_mib"]
        common = dict(name="trl_grpo_loss_step", provider=provider, mode="full", x_name="tokens", x_value=tokens,
                      config=config + f"; paged_in={r['paged_in_mib']:.1f} MiB")
        rows.append(dict(common, metric="steps_per_s", unit="1/s", p50=rate[0], p20=rate[1], p80=rate[2]))
        rows.append(dict(common, metric="peak_extra_rss", unit="MiB", p50=mem, p20=mem, p80=mem))
    ratios = {}
    stock = results["trl"]
    for provider, r in results.items():
        if provider != "trl":
            ratios[f"{provider}_peak_ratio"] = r["peak_extra_mib"] / max(stock["peak_extra_mib"], 1e-9)
            ratios[f"{provider}_speedup"] = quantiles(stock["step_s"])[0] / quantiles(r["step_s"])[0]
    return rows, ratios


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns {"rows": the rows, "ratios": :func:`summarize`'s ratios, "csv": the CSV path or
    None}."""
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
    ap.add_argument("--device", default="cpu", help=f"one of {DEVICES}")
    ap.add_argument("--liger", action="store_true", help="add the Liger-loss side (needs liger_kernel)")
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
        return {}
    check_device(args.device)
    if args.liger:
        liger_loss_class()  # refuse before any work
    if not args.no_csv:
        require_clean_tree(args.allow_dirty)
    if args.smoke:
        args.hidden, args.vocab, args.completions, args.prompt_len, args.completion_len, args.repeats = (
            64, 4096, 2, 8, 16, 1)
    pin_threads(args.threads)
    load_start = os.getloadavg()[0]
    providers = PROVIDERS + ((LIGER,) if args.liger else ())
    with tempfile.TemporaryDirectory(prefix="bench-integrations-") as work:
        model_dir = Path(work) / "model"
        build_model(model_dir, args.hidden, args.vocab, args.layers)
        results = {}
        for provider in providers:
            spec = dict(provider=provider, model=str(model_dir), out=str(Path(work) / provider),
                        completions=args.completions, prompt_len=args.prompt_len, completion_len=args.completion_len,
                        repeats=args.repeats, threads=args.threads, device=args.device)
            results[provider] = run_side(spec, args.timeout)
            r = results[provider]
            print(f"{provider}: peak +{r['peak_extra_mib']:.0f} MiB (paged in {r['paged_in_mib']:.1f} MiB), first "
                  f"step {r['first_s']:.2f} s, steps {', '.join(f'{t:.2f}' for t in r['step_s'])} s", flush=True)
    import trl

    tokens = results["trl"]["scored_tokens"]
    peak_kind = "torch peak allocated CUDA memory - allocated" if args.device == "cuda" else "VmHWM - RSS"
    config = (f"H={args.hidden} V={args.vocab} layers={args.layers} tied B={args.completions} prompt={args.prompt_len} "
              f"completion={args.completion_len} ({tokens} scored tokens) beta=0 dapo fp32 device={args.device} "
              f"threads={args.threads} trl={trl.__version__}; peak = {peak_kind} before the first loss step "
              f"(weights paged in first), fresh subprocess per side; load avg 1 min {load_start:.2f} at start, "
              f"{os.getloadavg()[0]:.2f} at end")
    rows, ratios = summarize(results, config)
    print_table(rows)
    for provider in providers[1:]:
        mem_ratio, speed = ratios[f"{provider}_peak_ratio"], ratios[f"{provider}_speedup"]
        target = f" (target <= 0.3x at >= 1x: {'met' if mem_ratio <= 0.3 and speed >= 1.0 else 'not met'})"
        print(f"{provider} / stock: peak memory {mem_ratio:.3f}x, steps/s {speed:.3f}x"
              f"{target if provider == 'fastpo' else ''}")
    path = None
    if not args.no_csv:
        path = append_rows("integrations", rows, args.results_dir)
        print(f"appended {len(rows)} rows to {path}")
    return dict(rows=rows, ratios=ratios, csv=path)


if __name__ == "__main__":
    main()
