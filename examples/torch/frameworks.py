#!/usr/bin/env python3
"""halfstep inside real training frameworks, side by side with the standard pipeline on the same
model, data and seed, on the CPU:

  trainer      Hugging Face Trainer, bf16=True (autocast), a GPT-2-shaped model: halfstep's
               FusedAdamW (clipping fused, Trainer's max_grad_norm 0) passed as optimizers=, next to
               Trainer's own torch.optim.AdamW with its clip_grad_norm_.
  accelerate   accelerate's own loop (Accelerator(mixed_precision="bf16")), a Llama-shaped model:
               FusedAdamW next to torch.optim.AdamW with accelerator.clip_grad_norm_.
  gradscaler   the loop PyTorch's AMP documentation teaches, fp16 autocast: halfstep.torch.GradScaler
               and FusedAdamW next to torch.amp.GradScaler + clip_grad_norm_ + torch.optim.AdamW. The
               scale starts at 2^24, so both back off through overflows and grow back: they must
               skip the same steps with the same scales.
  trainer-ddp  Trainer with the GPT-2-shaped model on N processes (torchrun): Trainer wraps it in
               DistributedDataParallel after the optimizer was built.
  trainer-fsdp Trainer over a model that transformers shards with FSDP2 as it loads
               (from_pretrained(distributed_config=DistributedConfig(fsdp_size=N))): FusedAdamW
               given as optimizer_cls_and_kwargs, on its DTensor shards. Run under torchrun with N
               processes (gloo).

--device cuda runs the same on a GPU with fp16 where the CPU runs bf16: Trainer with fp16=True and
accelerate with mixed_precision="fp16" (their torch.amp.GradScaler then drives the fused step) and
the GradScaler loop on CUDA; trainer-fsdp over NCCL, one GPU per process (bench/gpu_check.sh runs
these).

Every model is built from a small configuration with random weights (nothing is downloaded). The
data is a learnable synthetic language: each sequence counts up from a random start by a random
stride, modulo the vocabulary.

--check compares each pair: the losses agree within a tolerance (below), the skipped steps and the
loss scales are the same. --out writes the curves as JSON, which examples/torch/plot_frameworks.py
draws.

What the difference measures. Each run also trains the standard pipeline a second time with
torch.optim.AdamW(fused=True) in place of its default (foreach) implementation: two torch
optimizers that compute the same update with other fp32 roundings. The largest relative loss
difference between those two is printed next to halfstep's: on these small bf16 models a
difference of a few 1e-4 is what any change of rounding order gives, not a defect of either.

Tolerance. Both sides compute AdamW in fp32 (halfstep exactly rounded from its exact global norm,
torch.optim.AdamW with its own fp32 arithmetic), so their updates differ by a few fp32 roundings,
about 2^-20 relative. The loss under bf16 autocast is computed from the weights rounded to bf16 (8
significant bits): a weight that the two runs hold on either side of a rounding boundary differs
by one bf16 ulp, 2^-8 relative, in the forward pass. A loss can therefore differ by up to one bf16
rounding of its inputs, 2^-8 relative, and no more than that while the runs agree; for fp16
autocast the bound is fp16's 2^-11, but its activations are rounded too: 2^-8 is used for every
pair. Measured differences are far below (see bench/RESULTS.md); a real defect (a wrong learning
rate, a missed bias correction, an unscaled gradient) moves the loss by more within 30 steps.

--moments uint8 gives halfstep's side 8-bit block-wise moments (exp_avg_dtype=torch.uint8): the
GPT-2-shaped model's four MLP weights (58% of its parameters) hold codes, the rest fp32 moments
(the Llama-shaped one has no tensor large enough: it runs as with fp32 moments). The same
tolerance holds: measured, the 8-bit run differs from the standard pipeline no more than torch's
fused AdamW does from its default (bench/RESULTS.md).

usage: examples/torch/frameworks.py [--runs trainer,accelerate,gradscaler] [--steps 30] [--device cpu|cuda]
                                   [--moments fp32|uint8] [--out FILE] [--check]
       torchrun --nproc_per_node 2 examples/torch/frameworks.py --runs trainer-ddp,trainer-fsdp --workdir DIR --check
"""

import argparse
import json
import math
import os
import sys
import tempfile

import torch  # before halfstep: PyTorch's own NCCL is the process's

try:
    import halfstep.torch as hst
except ImportError:  # running from the source tree without pip install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    import halfstep.torch as hst

VOCAB, SEQ, BATCH, LR, WD, CLIP = 64, 24, 8, 3e-3, 0.01, 1.0
TOLERANCE = 2.0 ** -8


def dataset(n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": x, "labels": x} for x in ids]


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ))


def llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=32,
                       intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ)


def llama():
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


def schedule(opt, steps):
    """Linear warm-up over 5 steps, then linear decay to a tenth."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / 5, 1.0 - 0.9 * max(0, s - 5) / max(steps - 5, 1)))


# --moments uint8: halfstep's side holds 8-bit block-wise moments (exp_avg_dtype=torch.uint8); the
# GPT-2-shaped model's MLP weights (32 x 128 and 128 x 32) hold codes, its other tensors are too
# small and keep fp32 moments.
STATE = {}


def halfstep_options(compute):
    return dict(lr=LR, weight_decay=WD, max_grad_norm=CLIP, compute_dtype=compute, **STATE)


def halfstep_optimizer(params, compute=torch.bfloat16):
    return hst.FusedAdamW(params, **halfstep_options(compute))


def standard_optimizer(params, fused=False):
    """torch.optim.AdamW: its default implementation, or its fused one (the baseline's second run)."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, **({"fused": True} if fused else {}))


def trainer_losses(model, steps, halfstep, workdir, fsdp=False, device="cpu", fused=False):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Losses(TrainerCallback):
        def __init__(self):
            self.loss = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.loss.append(float(logs["loss"]))

    cpu = device == "cpu"
    args = TrainingArguments(output_dir=os.path.join(workdir, "trainer"), per_device_train_batch_size=BATCH,
                             max_steps=steps, bf16=cpu, fp16=not cpu, use_cpu=cpu, logging_steps=1, report_to=[],
                             save_strategy="no", seed=0, disable_tqdm=True, learning_rate=LR, weight_decay=WD,
                             lr_scheduler_type="constant", max_grad_norm=0.0 if halfstep else CLIP)
    losses = Losses()
    kwargs = {}
    if fsdp:
        # Trainer builds the optimizer itself over the sharded model; its own is torch.optim.AdamW.
        if halfstep:
            kwargs["optimizer_cls_and_kwargs"] = (hst.FusedAdamW, halfstep_options(compute_of(device)))
        else:
            kwargs["optimizer_cls_and_kwargs"] = (torch.optim.AdamW, dict(lr=LR, weight_decay=WD))
    else:
        model.to(device)
        opt = halfstep_optimizer(model.parameters(), compute_of(device)) if halfstep else standard_optimizer(
            model.parameters(), fused)
        kwargs["optimizers"] = (opt, schedule(opt, steps))
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[losses], **kwargs)
    trainer.train()
    return {"loss": losses.loss}


def compute_of(device):
    """The autocast format: bf16 on the CPU (PyTorch's CPU autocast and the frameworks' CPU mode),
    fp16 with a GradScaler on the GPU."""
    return torch.bfloat16 if device == "cpu" else torch.float16


def run_trainer(steps, workdir, device):
    return {"halfstep": trainer_losses(gpt2(), steps, True, workdir, device=device),
            "standard": trainer_losses(gpt2(), steps, False, workdir, device=device),
            "fused": trainer_losses(gpt2(), steps, False, workdir, device=device, fused=True)}


def run_accelerate(steps, workdir, device):
    from accelerate import Accelerator
    out = {}
    for side in ("halfstep", "standard", "fused"):
        accelerator = Accelerator(mixed_precision="bf16" if device == "cpu" else "fp16", cpu=device == "cpu")
        model = llama().to(accelerator.device)
        opt = halfstep_optimizer(model.parameters(), compute_of(device)) if side == "halfstep" else \
            standard_optimizer(model.parameters(), side == "fused")
        sched = schedule(opt, steps)
        loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=False,
                                             collate_fn=lambda b: {k: torch.stack([x[k] for x in b]) for k in b[0]})
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
        losses = []
        for step, batch in zip(range(steps), loader):
            with accelerator.autocast():
                loss = model(**batch).loss
            accelerator.backward(loss)
            if side != "halfstep":
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        out[side] = {"loss": losses}
    return out


def run_gradscaler(steps, workdir, device):
    out = {}
    for side in ("halfstep", "standard", "fused"):
        model = gpt2().to(device)
        params = list(model.parameters())
        if side == "halfstep":
            opt = halfstep_optimizer(params, compute=torch.float16)
            scaler = hst.GradScaler(device, init_scale=2.0 ** 24, growth_interval=8)
        else:
            opt = standard_optimizer(params, side == "fused")
            scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 24, growth_interval=8)
        sched = schedule(opt, steps)
        data = dataset()
        record = {"loss": [], "scale": [], "skipped": []}
        for step in range(steps):
            batch = data[step * BATCH:(step + 1) * BATCH]
            ids = torch.stack([x["input_ids"] for x in batch]).to(device)
            with torch.autocast(device, dtype=torch.float16):
                loss = model(input_ids=ids, labels=ids).loss
            scale = float(scaler.get_scale())
            scaler.scale(loss).backward()
            if side != "halfstep":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, CLIP)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
            skipped = opt.last_report()["outcome"] != "applied" if side == "halfstep" else \
                float(scaler.get_scale()) < scale  # GradScaler backs off only on an inf/NaN
            record["loss"].append(float(loss.detach()))
            record["scale"].append(scale)
            record["skipped"].append(bool(skipped))
        out[side] = record
    return out


def init_distributed(device):
    import torch.distributed as dist
    if dist.is_initialized():
        return
    if device == "cpu":
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")


def run_trainer_ddp(steps, workdir, device):
    """Trainer on several processes with a plain model: it wraps the model in DDP itself."""
    import torch.distributed as dist
    init_distributed(device)
    out = run_trainer(steps, workdir, device)
    out["world"] = dist.get_world_size()
    return out


def run_trainer_fsdp(steps, workdir, device):
    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig
    init_distributed(device)
    world = dist.get_world_size()
    path = os.path.join(workdir, "tiny-llama")
    if dist.get_rank() == 0:
        llama().save_pretrained(path)  # random weights, saved here to be loaded sharded
    dist.barrier()
    out = {"world": world}
    for side in ("halfstep", "standard"):
        model = LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=world))
        placements = str(next(model.parameters()).placements)
        out[side] = trainer_losses(model, steps, side == "halfstep", workdir, fsdp=True, device=device)
        out[side]["placements"] = placements
    return out


RUNS = {"trainer": run_trainer, "accelerate": run_accelerate, "gradscaler": run_gradscaler,
        "trainer-ddp": run_trainer_ddp, "trainer-fsdp": run_trainer_fsdp}
DISTRIBUTED = ("trainer-ddp", "trainer-fsdp")


def largest_difference(a, b):
    """The largest relative difference between two runs' losses."""
    return max(abs(x - y) / abs(y) for x, y in zip(a["loss"], b["loss"]))


def check(results):
    """The pairs agree: losses within TOLERANCE (relative), the same skips and scales. Returns
    the lines to print and whether every check held."""
    lines, ok = [], True
    for name, pair in results.items():
        if name == "versions" or not isinstance(pair, dict) or "standard" not in pair:
            continue
        a, b = pair["halfstep"], pair["standard"]
        worst = largest_difference(a, b)
        good = len(a["loss"]) == len(b["loss"]) > 0 and worst <= TOLERANCE and all(map(math.isfinite, a["loss"]))
        line = "%-12s %d steps, loss %.4f -> %.4f (halfstep) / %.4f -> %.4f (standard), largest relative " \
               "difference %.2e (2^%.1f; tolerance 2^-8)" % (name, len(a["loss"]), a["loss"][0], a["loss"][-1],
                                                           b["loss"][0], b["loss"][-1], worst,
                                                           math.log2(worst) if worst > 0 else -math.inf)
        if "fused" in pair:
            line += "; torch's fused AdamW against its default: %.2e" % largest_difference(pair["fused"], b)
        if "skipped" in a:
            same = a["skipped"] == b["skipped"] and a["scale"] == b["scale"]
            good = good and same
            line += "; skipped steps %s %s, scales %s" % (
                [i for i, s in enumerate(a["skipped"]) if s], "same" if same else "DIFFER",
                "same" if a["scale"] == b["scale"] else "DIFFER")
        lines.append(("ok    " if good else "FAILED ") + line)
        ok = ok and good
    return lines, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="trainer,accelerate,gradscaler", help="comma-separated: " + ", ".join(RUNS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--workdir", help="scratch directory (default: a temporary one; trainer-fsdp: shared by the ranks)")
    ap.add_argument("--out", help="write the curves here as JSON")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every pair agrees")
    ap.add_argument("--moments", default="fp32", choices=("fp32", "uint8"),
                    help="halfstep's moments: fp32 (the default) or 8-bit block-wise codes (exp_avg_dtype=torch.uint8)")
    args = ap.parse_args()
    if args.moments == "uint8":
        STATE.update(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    runs = args.runs.split(",")
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        ap.error("unknown run %s (choose from %s)" % (", ".join(unknown), ", ".join(RUNS)))
    if any(r in DISTRIBUTED for r in runs) and not all(r in DISTRIBUTED for r in runs):
        ap.error("%s run under torchrun, without the one-process runs" % " and ".join(DISTRIBUTED))
    import transformers
    import accelerate
    workdir = args.workdir or tempfile.mkdtemp(prefix="halfstep-frameworks-")
    results = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "accelerate": accelerate.__version__, "halfstep": sys.modules["halfstep"].version(), "device": args.device,
                            "halfstep moments": args.moments}}
    for name in runs:
        results[name] = RUNS[name](args.steps, workdir, args.device)
    lines, ok = check(results)
    if int(os.environ.get("RANK", "0")) == 0:
        print("versions:", ", ".join("%s %s" % kv for kv in results["versions"].items()))
        for line in lines:
            print(line)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    status = 1 if args.check and not ok else 0
    if any(r in DISTRIBUTED for r in runs):
        import torch.distributed as dist
        dist.destroy_process_group()
        # PyTorch 2.15's gloo can abort a rank while the interpreter finalizes (a worker thread
        # freeing a finished collective's tensors asks for the GIL too late: "terminate called
        # without an active exception"); everything is written, so the rank leaves without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    main()
