#!/usr/bin/env python3
"""Side-by-side benchmark: memfit against PyTorch on the same NVIDIA GPU.

usage: tools/gpu_vs_torch.py --memfit PATH [--python PY] [--device cuda] [--rounds 2]
                             [--out DIR] [--only memory,maxbatch,auto,speed] [--quick]
                             [--memfit-ld-library-path DIRS] [--timeout S]
                             [--max-batch-timeout S] [--self-test]

ResNet-50, 224x224, SGD momentum 0.9, steps 5 after 2 warm-up steps, the
configurations of ../shared/gpu/FACTS.md's PyTorch anchors, in four sections:

  memory    peak per strategy at batch 32 and 64, and the straight line
            through them (MiB per image, fixed MiB); torch's figure is
            torch.cuda.max_memory_allocated over the timed steps, memfit's
            its tracked peak.
  maxbatch  the largest batch under 3.5 GiB: memfit's `bench max-batch`
            (predicted) against torch's straight-line fit. The simulator
            takes minutes of one CPU core (3-4 at 224x224 on the 2-core dev
            machine), so it runs in the background from the start.
  auto      memory for time: memfit fp32 batch 64 `--checkpoint auto
            --memory-budget 1861MiB` against memfit with no plan.
  speed     img/s at batch 64 fp32 and batch 256 f16 / bf16.

Every run is its own process, so one run's allocator state never leaks into
the next and a crash is contained: memfit as `memfit bench step`, torch as
`PY tools/gpu_vs_torch.py --torch-worker JSON` (one JSON line out). Rounds
alternate the two tools per configuration (memfit, torch, memfit, torch, ...)
so both see the same machine noise; each side reports the median over its
rounds. Batch-32 runs serve only the memory fit and run one round: peaks
repeat exactly from round to round.

memfit gets the CUDA 13 / cuDNN 9.14 folders on LD_LIBRARY_PATH; torch must
not (it refuses the system cuDNN), so those folders are stripped from its
environment. The memfit side uses the standard library only.

Writes DIR/raw.jsonl (every run: command, output tails, parsed values,
error) and DIR/table.md (one table per section), and prints the tables.

--quick is the same code path sized for a CPU: ResNet-50 at 64x64, batches
4 and 8 (16 for speed), 1 step after 1 warm-up, 1 round, and budgets scaled
down so the plans still have to work (max-batch 1 GiB, auto 320 MiB). With
--device cpu torch runs on the CPU and its memory is n/a.

--self-test checks the output parsers and the table formatting on embedded
sample text (no torch, no memfit run) and exits 0 when they pass.

On the GPU machine, e.g.:
  python3 tools/gpu_vs_torch.py --memfit target/gpu-bundle/memfit --out $OUT
"""

import argparse
import hashlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
REPO = Path(__file__).resolve().parent.parent
MEMFIT_LD = "/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu"
SECTIONS = ("memory", "maxbatch", "auto", "speed")

# The PyTorch anchors of ../shared/gpu/FACTS.md (H200, torch 2.11.0+cu130),
# quoted in the targets so a reader sees what "this run" should resemble.
ANCHOR_AMP_LAYERS_MAX_BATCH = 133
ANCHOR_FP32_MIB_PER_IMG = 82.8
ANCHOR_IMG_S = {"f16": 5817, "bf16": 4625}

# (label, torch (strategy, precision), memfit (precision, checkpoint)): the
# anchor script's grid, each torch strategy beside memfit's nearest plan.
LAYERS = "stages:layer1,layer2,layer4"
STRATEGIES = [
    ("plain fp32", ("plain", "fp32"), ("fp32", "none")),
    ("AMP fp16", ("plain", "fp16"), ("f16", "none")),
    ("checkpoint_sequential 2", ("ckpt-seq-2", "fp32"), ("fp32", "segments:2")),
    ("checkpoint_sequential 4", ("ckpt-seq-4", "fp32"), ("fp32", "segments:4")),
    ("checkpoint_sequential 8", ("ckpt-seq-8", "fp32"), ("fp32", "segments:8")),
    ("checkpoint layer1,2,4", ("ckpt-layers", "fp32"), ("fp32", LAYERS)),
    ("AMP + layer1,2,4", ("ckpt-layers", "fp16"), ("f16", LAYERS)),
    ("AMP + checkpoint_sequential 4", ("ckpt-seq-4", "fp16"), ("f16", "segments:4")),
]
STRATEGY = {label: (t, m) for label, t, m in STRATEGIES}

# memfit `bench max-batch` rows (strategy, precision) -> the torch strategy
# whose fitted largest batch stands beside it.
MAX_BATCH_PEER = {
    ("none", "fp32"): "plain fp32",
    ("segments:2", "fp32"): "checkpoint_sequential 2",
    ("segments:4", "fp32"): "checkpoint_sequential 4",
    ("segments:8", "fp32"): "checkpoint_sequential 8",
    (LAYERS, "fp32"): "checkpoint layer1,2,4",
    ("none", "bf16"): "AMP fp16",
    ("none", "f16"): "AMP fp16",
    ("auto", "fp32"): "checkpoint layer1,2,4",
    ("auto", "bf16"): "AMP + layer1,2,4",
    ("auto", "f16"): "AMP + layer1,2,4",
}


class Settings:
    """The sizes of one run: the GPU defaults, or --quick's CPU-sized ones."""

    def __init__(self, quick, rounds, device):
        self.device = device
        self.rounds = 1 if quick else rounds
        self.image_size = 64 if quick else 224
        self.batches = (4, 8) if quick else (32, 64)
        self.speed_batch = 16 if quick else 256
        self.steps, self.warmup = (1, 1) if quick else (5, 2)
        self.max_batch_budget = "1GiB" if quick else "3.5GiB"
        self.auto_budget = "320MiB" if quick else "1861MiB"


# ---------------------------------------------------------------- parsing


def parse_size(text):
    """Bytes from memfit's fmt_bytes ("12.34 MiB", "123 B") or a budget
    ("3.5GiB"): binary units, as memfit prints and takes them."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(B|KiB|MiB|GiB|TiB)\s*", text)
    if not m:
        raise ValueError(f"not a memfit size: {text!r}")
    scale = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": 1 << 40}[m.group(2)]
    return round(float(m.group(1)) * scale)


def parse_step(stdout):
    """The figures of one `memfit bench step` run. The img/s is printed with
    more digits than the s/step, so it is the one the ratios use."""
    values = {}
    m = re.search(r"^median ([0-9.]+) s/step, ([0-9.]+) img/s$", stdout, re.M)
    if not m:
        raise ValueError("no 'median ... s/step, ... img/s' line")
    values["s_per_step"], values["img_per_s"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"^tracked peak: (.+?) \(reserved now (.+?)\)$", stdout, re.M)
    if not m:
        raise ValueError("no 'tracked peak: ... (reserved now ...)' line")
    values["tracked_peak"], values["reserved"] = parse_size(m.group(1)), parse_size(m.group(2))
    m = re.search(r"^predicted peak (.+?) vs measured (.+?)$", stdout, re.M)
    if m:
        values["predicted_peak"] = parse_size(m.group(1))
    m = re.search(r"^plan (.+) at micro-batch (\d+), (\w+)", stdout, re.M)
    if m:
        values["plan"], values["micro_batch"], values["precision"] = m.group(1), int(m.group(2)), m.group(3)
    return values


def parse_max_batch(stdout):
    """The rows of `memfit bench max-batch`'s table: strategy, precision,
    largest batch and predicted peak (None where memfit prints "-")."""
    lines = stdout.splitlines()
    head = next((i for i, l in enumerate(lines) if l.startswith("| strategy | precision | largest batch |")), None)
    if head is None:
        raise ValueError("no '| strategy | precision | largest batch |' table")
    rows = []
    for line in lines[head + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5:
            raise ValueError(f"max-batch row with {len(cells)} cells: {line!r}")
        peak = None if cells[3] == "-" else parse_size(cells[3])
        rows.append(dict(strategy=cells[0], precision=cells[1], batch=int(cells[2]), predicted_peak=peak))
    if not rows:
        raise ValueError("max-batch table has no rows")
    return rows


def parse_torch(stdout):
    """The worker's result: its last stdout line that is a JSON object."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line from the torch worker")


# ---------------------------------------------------------------- arithmetic


def fit_line(p, q):
    """Slope (bytes per image) and intercept (fixed bytes) of the line through
    two (batch, peak bytes) points: the anchors' MiB/img and fixed MiB."""
    (b1, m1), (b2, m2) = p, q
    slope = (m2 - m1) / (b2 - b1)
    return slope, m1 - slope * b1


def largest_batch(budget, slope, fixed):
    """The largest batch the fitted line keeps within `budget` bytes, as the
    anchor script extrapolates torch's (None for a flat or rising line)."""
    if slope <= 0:
        return None
    return max(0, int((budget - fixed) // slope))


def summarize(runs):
    """One side's figure for a configuration: the median over its rounds
    that worked, per value; the first error when none did."""
    ok = [r["values"] for r in runs if r["error"] is None]
    if not ok:
        return {"error": runs[0]["error"]}
    out = dict(ok[0])
    for k, v in ok[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs = [r[k] for r in ok if isinstance(r.get(k), (int, float))]
            out[k] = statistics.median(xs) if xs else None
    out["rounds"] = len(ok)
    failed = [r["error"] for r in runs if r["error"] is not None]
    if failed:
        out["failed_rounds"] = failed
    return out


# ---------------------------------------------------------------- formatting


def fmt_mib(b):
    """Bytes as MiB, the unit of FACTS.md's anchor table."""
    return "n/a" if b is None else f"{b / MiB:.0f} MiB"


def fmt_ratio(x):
    return "n/a" if x is None else f"{x:.2f}x"


def fmt_speed(x):
    return "n/a" if x is None else f"{x:.1f}"


def fmt_met(ok):
    return "n/a" if ok is None else ("yes" if ok else "no")


def ratio(num, den):
    """num / den, or None when either side has no figure."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def cell(summary, fmt):
    """A side's table cell: its formatted figure, or its error, shortened."""
    if "error" in summary:
        e = summary["error"]
        return (e if e.startswith("error:") else "error: " + e)[:120]
    return fmt(summary)


def md_table(headers, rows):
    """A Markdown table; pipes inside cells are escaped."""
    esc = lambda c: str(c).replace("|", "\\|")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def section_md(title, headers, rows, notes):
    """A section of table.md: heading, table, then its notes as a list."""
    return f"## {title}\n\n" + md_table(headers, rows) + "".join(f"\n- {n}" for n in notes) + "\n"


# ---------------------------------------------------------------- the runs


def env_with_ld(dirs):
    """The environment with `dirs` in front of LD_LIBRARY_PATH (memfit's
    dlopen'ed CUDA and cuDNN)."""
    env = dict(os.environ)
    old = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = dirs + (":" + old if old else "")
    return env


def env_without_ld(dirs):
    """The environment with `dirs` removed from LD_LIBRARY_PATH: torch
    brings its own cuDNN and refuses the system one."""
    env = dict(os.environ)
    drop = {d.rstrip("/") for d in dirs.split(":") if d}
    kept = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d and d.rstrip("/") not in drop]
    if kept:
        env["LD_LIBRARY_PATH"] = ":".join(kept)
    else:
        env.pop("LD_LIBRARY_PATH", None)
    return env


def tail(text, lines=30):
    return "\n".join(text.splitlines()[-lines:])


def last_error_line(stderr):
    """The reason a run failed: memfit's `error: ...` line, else the last
    line on stderr (a Python exception's message)."""
    lines = [l for l in stderr.splitlines() if l.strip()]
    errs = [l for l in lines if l.startswith("error:")]
    return (errs or lines or ["(no message)"])[-1].strip()


def describe(rec):
    """A run in a few words for the progress lines: peak and speed, or why not."""
    if rec["error"]:
        return rec["error"]
    v = rec["values"]
    peak = v.get("tracked_peak", v.get("peak_alloc"))
    return f"peak {fmt_mib(peak)}, {v['img_per_s']:.1f} img/s"


class Bench:
    """Runs both tools, memoizes each configuration's rounds (sections share
    runs: the speed section's fp32 batch 64 is the memory section's) and logs
    every run to raw.jsonl as it ends."""

    def __init__(self, args, s):
        self.args, self.s = args, s
        self.memfit_env = env_with_ld(args.memfit_ld_library_path)
        self.torch_env = env_without_ld(args.memfit_ld_library_path)
        self.raw = open(Path(args.out) / "raw.jsonl", "w")
        self.cache = {}
        self.pending_max_batch = None
        self.t0 = time.monotonic()

    def log(self, msg):
        print(f"[{time.monotonic() - self.t0:7.1f} s] {msg}", file=sys.stderr, flush=True)

    def execute(self, side, cmd, env, parse, label):
        """One process, waited for: its parsed values or its error."""
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=self.args.timeout)
            return self.record(side, label, cmd, t, parse, p.returncode, p.stdout, p.stderr)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            return self.record(side, label, cmd, t, parse, None, out, "", f"timed out after {self.args.timeout:.0f} s")
        except OSError as e:
            return self.record(side, label, cmd, t, parse, None, "", "", f"{type(e).__name__}: {e}")

    def record(self, side, label, cmd, t, parse, rc, stdout, stderr, error=None):
        """Parses a finished run and appends it to raw.jsonl: a parser that
        finds no figures makes an error of the run, not a crash."""
        rec = dict(side=side, label=label, cmd=cmd, rc=rc, values=None, error=error,
                   stdout_tail=tail(stdout), stderr_tail=tail(stderr, 10))
        if error is None and rc != 0:
            rec["error"] = last_error_line(stderr)
        elif error is None:
            try:
                rec["values"] = parse(stdout)
            except ValueError as e:
                rec["error"] = f"unparsed output: {e}"
        rec["seconds"] = round(time.monotonic() - t, 2)
        self.raw.write(json.dumps(rec) + "\n")
        self.raw.flush()
        return rec

    def memfit_step_cmd(self, m):
        """`memfit bench step` for a memfit configuration dict."""
        s = self.s
        cmd = [self.args.memfit, "bench", "step", "--model", "resnet50", "--image-size", str(s.image_size),
               "--batch-size", str(m["batch"]), "--steps", str(s.steps), "--warmup", str(s.warmup),
               "--precision", m["precision"], "--checkpoint", m["checkpoint"], "--device", s.device]
        if m.get("budget"):
            cmd += ["--memory-budget", m["budget"]]
        return cmd

    def torch_cmd(self, t):
        cfg = dict(t, image_size=self.s.image_size, steps=self.s.steps, warmup=self.s.warmup, device=self.s.device)
        return [self.args.python, str(Path(__file__).resolve()), "--torch-worker", json.dumps(cfg)]

    def one(self, side, cfg, label):
        if side == "memfit":
            return self.execute(side, self.memfit_step_cmd(cfg), self.memfit_env, parse_step, label)
        return self.execute(side, self.torch_cmd(cfg), self.torch_env, parse_torch, label)

    def measure(self, label, items, rounds=None):
        """Alternates the (side, config) items round by round and returns one
        summary per item; a configuration already run reuses its rounds."""
        rounds = rounds or self.s.rounds
        t = time.monotonic()
        keys = [(side, json.dumps(cfg, sort_keys=True)) for side, cfg in items]
        for r in range(rounds):
            for (side, cfg), key in zip(items, keys):
                done = self.cache.setdefault(key, [])
                if len(done) > r:
                    continue
                rec = self.one(side, cfg, label)
                done.append(rec)
                self.log(f"{label}: {side} round {r + 1}/{rounds} ({rec['seconds']:.1f} s): {describe(rec)}")
        self.log(f"{label}: done in {time.monotonic() - t:.1f} s")
        return [summarize(self.cache[k][:rounds]) for k in keys]

    def start_max_batch(self):
        """Starts `memfit bench max-batch` in the background: it runs the
        shapes-only simulator on one CPU core for minutes (about 3 at 224x224
        on the dev machine), time the GPU runs can hide. A prediction: one
        run, no rounds."""
        cmd = [self.args.memfit, "bench", "max-batch", "--model", "resnet50", "--image-size", str(self.s.image_size),
               "--memory-budget", self.s.max_batch_budget, "--device", self.s.device]
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(cmd, env=self.memfit_env, stdout=out, stderr=err, text=True)
        self.pending_max_batch = (cmd, time.monotonic(), proc, out, err)
        self.log(f"max-batch: started in the background (pid {proc.pid})")

    def stop_max_batch(self):
        """Ends the background max-batch run should the script stop early."""
        if self.pending_max_batch and self.pending_max_batch[2].poll() is None:
            self.pending_max_batch[2].kill()
            self.pending_max_batch[2].wait()

    def max_batch(self):
        """Waits for the background max-batch run and records it."""
        cmd, t, proc, out, err = self.pending_max_batch
        try:
            proc.wait(timeout=max(1.0, self.args.max_batch_timeout - (time.monotonic() - t)))
            error = None
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            error = f"timed out after {self.args.max_batch_timeout:.0f} s"
        out.seek(0)
        err.seek(0)
        rec = self.record("memfit", "max-batch", cmd, t, parse_max_batch, proc.returncode, out.read(), err.read(), error)
        self.log(f"max-batch: memfit done ({rec['seconds']:.1f} s since its start): {rec['error'] or 'ok'}")
        return rec


def memfit_cfg(label, batch):
    """memfit's side of a STRATEGIES row at `batch`."""
    precision, checkpoint = STRATEGY[label][1]
    return dict(precision=precision, checkpoint=checkpoint, batch=batch)


def torch_cfg(label, batch, **extra):
    """torch's side of a STRATEGIES row at `batch` (the worker's JSON)."""
    strategy, precision = STRATEGY[label][0]
    return dict(strategy=strategy, precision=precision, batch=batch, **extra)


# ---------------------------------------------------------------- sections


def memory_runs(b, out):
    """Both tools at both batches for every strategy (memoized), and each
    side's line through the two peaks, into `out` as each strategy ends (a
    run stopped midway keeps the strategies done)."""
    small, big = b.s.batches
    for label, _, _ in STRATEGIES:
        m1, t1 = b.measure(f"memory {label} b{small}", [("memfit", memfit_cfg(label, small)), ("torch", torch_cfg(label, small))], rounds=1)
        m2, t2 = b.measure(f"memory {label} b{big}", [("memfit", memfit_cfg(label, big)), ("torch", torch_cfg(label, big))])
        fits = {}
        for side, p, q, key in (("memfit", m1, m2, "tracked_peak"), ("torch", t1, t2, "peak_alloc")):
            if p.get(key) is not None and q.get(key) is not None:
                fits[side] = fit_line((small, p[key]), (big, q[key]))
        out[label] = dict(memfit=(m1, m2), torch=(t1, t2), fit=fits)
    return out


def section_memory(b, runs):
    """Section 1: peak per strategy at both batches and per image, torch over
    memfit, beside the img/s each run reached."""
    small, big = b.s.batches
    rows = []
    for label, _, _ in STRATEGIES:
        if label not in runs:
            continue
        r = runs[label]
        for i, batch in enumerate((small, big)):
            m, t = r["memfit"][i], r["torch"][i]
            q = ratio(t.get("peak_alloc"), m.get("tracked_peak"))
            speed = f"{fmt_speed(m.get('img_per_s'))} / {fmt_speed(t.get('img_per_s'))}"
            rows.append([f"{label}, batch {batch}", cell(m, lambda x: fmt_mib(x["tracked_peak"])),
                         cell(t, lambda x: fmt_mib(x.get("peak_alloc"))), fmt_ratio(q), ">= 1.00x",
                         fmt_met(None if q is None else q >= 1.0), speed])
        fm, ft = r["fit"].get("memfit"), r["fit"].get("torch")
        line = lambda f: "n/a" if f is None else f"{f[0] / MiB:.1f} MiB/img + {f[1] / MiB:.0f} MiB"
        q = ratio(ft and ft[0], fm and fm[0])
        rows.append([f"{label}, line {small}->{big}", line(fm), line(ft), fmt_ratio(q), ">= 1.00x (per image)",
                     fmt_met(None if q is None else q >= 1.0), ""])
    notes = [
        "ratio = PyTorch peak / memfit tracked peak (above 1: memfit uses less); the line rows compare MiB per image.",
        "PyTorch: torch.cuda.max_memory_allocated over the timed steps after reset_peak_memory_stats (params, grads, "
        "momentum, activations, workspaces; no CUDA context); n/a on the CPU. memfit: its pool's tracked peak over the timed steps.",
        "memfit's segments:K cuts the network into K segments of about equal cost, not equal module count as "
        "checkpoint_sequential does: the rows pair the same K, not the same cut points.",
        "PyTorch runs NCHW (as the anchors) with in-place ReLUs made out-of-place under checkpointing; memfit always runs NHWC.",
        "AMP fp16 = torch.autocast float16 + GradScaler; memfit --precision f16 (dynamic loss scaler).",
        f"batch {small} runs one round (its peak feeds the line only); batch {big} is the median of {b.s.rounds} round(s).",
    ]
    return section_md(f"Memory per strategy (ResNet-50, {b.s.image_size}x{b.s.image_size}, SGD momentum)",
                      ["config", "memfit", "PyTorch", "ratio", "target", "met?", "img/s memfit / PyTorch"], rows, notes)


def section_maxbatch(b, runs):
    """Section 2: memfit's predicted largest batch per strategy beside torch's
    extrapolated one, and the fp32 MiB/img both lines give."""
    budget = parse_size(b.s.max_batch_budget)
    rec = b.max_batch()
    torch_max = {label: largest_batch(budget, *r["fit"]["torch"]) if "torch" in r["fit"] else None
                 for label, r in runs.items()}
    rows = []
    if rec["error"]:
        rows.append(["bench max-batch", cell(rec, None), "", "", "", "n/a"])
    for row in rec["values"] or []:
        peer = MAX_BATCH_PEER.get((row["strategy"], row["precision"]))
        tb = torch_max.get(peer) if peer else None
        target, met = "", None
        if row["strategy"] == "auto" and row["precision"] in ("bf16", "f16"):
            target = f">= 2x torch AMP + layer1,2,4 (anchor {ANCHOR_AMP_LAYERS_MAX_BATCH})"
            met = None if tb is None else row["batch"] >= 2 * tb
        rows.append([f"{row['strategy']} {row['precision']}", f"{row['batch']} ({fmt_mib(row['predicted_peak'])})",
                     f"{tb if tb is not None else 'n/a'} ({peer})" if peer else "-",
                     fmt_ratio(ratio(row["batch"], tb)), target, fmt_met(met)])
    fm, ft = runs["plain fp32"]["fit"].get("memfit"), runs["plain fp32"]["fit"].get("torch")
    mm, tm = fm and fm[0] / MiB, ft and ft[0] / MiB
    rows.append(["none fp32 MiB/img (line through the memory runs)", "n/a" if mm is None else f"{mm:.1f}",
                 "n/a" if tm is None else f"{tm:.1f}", fmt_ratio(ratio(tm, mm)),
                 f"<= PyTorch's (anchor {ANCHOR_FP32_MIB_PER_IMG})", fmt_met(None if mm is None or tm is None else mm <= tm)])
    notes = [
        "memfit: `bench max-batch`, the largest batch whose predicted peak (shapes-only simulator) fits; "
        f"PyTorch: the straight line through its batch {b.s.batches[0]} and {b.s.batches[1]} peaks extrapolated "
        "to the budget, as the anchor script does.",
        "ratio = memfit batch / PyTorch batch. memfit bf16 rows stand beside torch's AMP fp16 (the same bytes per value).",
        "auto fp32 stands beside torch's checkpoint layer1,2,4 fp32; BN+ReLU recompute rows have no PyTorch peer.",
    ]
    return section_md(f"Largest batch under {b.s.max_batch_budget}",
                      ["config", "memfit", "PyTorch", "ratio", "target", "met?"], rows, notes)


def section_auto(b):
    """Section 3: what memfit's auto plan costs in time to fit a budget."""
    big = b.s.batches[1]
    auto = dict(precision="fp32", checkpoint="auto", batch=big, budget=b.s.auto_budget)
    # The no-plan run is made afresh beside the auto one ("section" only
    # keeps it out of the cache), so the 1.12x target compares two runs of
    # the same rounds, not one against the memory section's.
    none = dict(memfit_cfg("plain fp32", big), section="auto")
    ma, mn, tl, tp = b.measure(f"auto b{big}", [("memfit", auto), ("memfit", none),
                                                ("torch", torch_cfg("checkpoint layer1,2,4", big)),
                                                ("torch", torch_cfg("plain fp32", big))])
    mt = ratio(mn.get("img_per_s"), ma.get("img_per_s"))
    tt = ratio(tp.get("img_per_s"), tl.get("img_per_s"))
    budget = parse_size(b.s.auto_budget)
    peak = ma.get("tracked_peak")
    rows = [
        [f"fp32 batch {big}: time auto / none", cell(ma, lambda x: f"{big / x['img_per_s']:.4f} vs {big / mn['img_per_s']:.4f} s/step"
                                                     if "img_per_s" in mn else "n/a"),
         cell(tl, lambda x: f"layer1,2,4 {big / x['img_per_s']:.4f} vs plain {big / tp['img_per_s']:.4f} s/step"
              if "img_per_s" in tp else "n/a"),
         fmt_ratio(mt), "<= 1.12x", fmt_met(None if mt is None else mt <= 1.12)],
        [f"fp32 batch {big}: peak under auto", cell(ma, lambda x: f"{fmt_mib(peak)} of {b.s.auto_budget}"),
         cell(tl, lambda x: f"layer1,2,4 {fmt_mib(x.get('peak_alloc'))}"), fmt_ratio(ratio(peak, budget)),
         "<= 1.00x of the budget", fmt_met(None if peak is None else peak <= budget)],
        [f"fp32 batch {big}: memfit auto plan", cell(ma, lambda x: x.get("plan", "?")), "", "", "", ""],
    ]
    notes = [
        f"ratio = memfit's s/step with --checkpoint auto --memory-budget {b.s.auto_budget} / its s/step with no plan "
        "(from img/s, which memfit prints with more digits); the PyTorch column shows what checkpoint layer1,2,4 costs "
        f"torch at the same batch ({fmt_ratio(tt)} of plain), for scale.",
    ]
    return section_md("Memory for time: memfit auto plan", ["config", "memfit", "PyTorch", "ratio", "target", "met?"],
                      rows, notes)


def speed_row(label, m, t, anchor=None):
    """A speed table row: memfit over torch img/s, judged against the 0.8x
    floor and the 1.1x aim."""
    q = ratio(m.get("img_per_s"), t.get("img_per_s"))
    met = None if q is None else ("yes (aim 1.1)" if q >= 1.1 else "yes (floor 0.8)" if q >= 0.8 else "no")
    tcell = cell(t, lambda x: f"{x['img_per_s']:.1f} img/s") + (f" (anchor {anchor})" if anchor else "")
    return [label, cell(m, lambda x: f"{x['img_per_s']:.1f} img/s"), tcell, fmt_ratio(q), ">= 0.8x, aim 1.1x",
            met or "n/a"]


def section_speed(b):
    """Section 4: img/s at fp32 batch 64 (against torch's two cuDNN settings)
    and at f16 / bf16 batch 256 (against the FACTS.md speed anchors)."""
    big, sb = b.s.batches[1], b.s.speed_batch
    m, t_plain, t_bench = b.measure(f"speed fp32 b{big}", [
        ("memfit", memfit_cfg("plain fp32", big)), ("torch", torch_cfg("plain fp32", big)),
        ("torch", torch_cfg("plain fp32", big, cudnn_benchmark=True))])
    rows = [speed_row(f"fp32 batch {big} vs torch default (TF32 convs, benchmark off)", m, t_plain),
            speed_row(f"fp32 batch {big} vs torch cudnn.benchmark=True", m, t_bench)]
    for prec, torch_prec in (("f16", "fp16"), ("bf16", "bf16")):
        mc = dict(precision=prec, checkpoint="none", batch=sb)
        tc = dict(strategy="plain", precision=torch_prec, batch=sb, channels_last=True, cudnn_benchmark=True)
        m, t = b.measure(f"speed {prec} b{sb}", [("memfit", mc), ("torch", tc)])
        rows.append(speed_row(f"{prec} batch {sb} vs torch autocast channels-last, benchmark on", m, t,
                              ANCHOR_IMG_S[prec] if sb == 256 else None))
    notes = ["ratio = memfit img/s / PyTorch img/s (median over rounds of each run's median step).",
             "PyTorch fp32 runs NCHW with cuDNN TF32 allowed (torch's default); memfit runs NHWC, convolutions in TF32.",
             "Anchors (FACTS.md, batch 256, benchmark on): AMP fp16 channels-last 5817 img/s, bf16 4625 img/s."]
    return section_md("Speed", ["config", "memfit", "PyTorch", "ratio", "target", "met?"], rows, notes)


# ---------------------------------------------------------------- versions


def memfit_identity(b):
    """What memfit binary ran: its path, sha256 and `--version` answer (or
    the error, should a build not have the flag)."""
    path = Path(b.args.memfit)
    info = dict(path=str(path.resolve()), sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    rec = b.execute("memfit", [str(path), "--version"], b.memfit_env, lambda out: {"version": out.strip()}, "version")
    info["version"] = rec["error"] or rec["values"]["version"]
    return info


def torch_identity(b):
    """torch, cuDNN and GPU as the torch worker sees them; fails the whole
    run early when torch cannot be imported or sees no GPU."""
    rec = b.execute("torch", b.torch_cmd({"probe": True}), b.torch_env, parse_torch, "versions")
    if rec["error"]:
        sys.exit(f"torch worker failed under {b.args.python}: {rec['error']}\n(pass --python PY with torch and torchvision)")
    return rec["values"]


def gpu_identity():
    """The driver and GPU nvidia-smi reports, or why it could not."""
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        return p.stdout.strip() or p.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi: {e}"


# ---------------------------------------------------------------- torch worker


def torch_worker(cfg):
    """One PyTorch configuration in this process; prints one JSON line.
    The model, forward and step follow ../shared/gpu/torch_gpu_anchor.py
    (copied: ../shared is not on the GPU machine), with the device, image
    size, channels-last and cudnn.benchmark as parameters."""
    import torch
    import torch.nn as nn
    import torchvision
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    dev = cfg.get("device", "cuda")
    cuda = dev.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit(f"error: torch {torch.__version__} sees no CUDA device")
    if cfg.get("probe"):
        print(json.dumps(dict(torch=torch.__version__, torchvision=torchvision.__version__, cuda=torch.version.cuda,
                              cudnn=torch.backends.cudnn.version(),
                              gpu=torch.cuda.get_device_name(dev) if cuda else None,
                              cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                              matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32)))
        return
    torch.backends.cudnn.benchmark = bool(cfg.get("cudnn_benchmark"))
    strategy, precision, batch, size = cfg["strategy"], cfg["precision"], cfg["batch"], cfg["image_size"]
    channels_last = bool(cfg.get("channels_last"))

    def forward(model, x):
        if strategy.startswith("ckpt-seq-"):
            k = int(strategy.split("-")[-1])
            seq = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool, model.layer1, model.layer2,
                                model.layer3, model.layer4, model.avgpool, nn.Flatten(1), model.fc)
            return checkpoint_sequential(seq, k, x, use_reentrant=False)
        if strategy == "ckpt-layers":
            x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
            x = checkpoint(model.layer1, x, use_reentrant=False)
            x = checkpoint(model.layer2, x, use_reentrant=False)
            x = model.layer3(x)
            x = checkpoint(model.layer4, x, use_reentrant=False)
            return model.fc(torch.flatten(model.avgpool(x), 1))
        return model(x)

    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(dev)
    if strategy.startswith("ckpt"):
        # torchvision's in-place ReLU breaks checkpoint_sequential at a segment
        # boundary (the saved input is modified in place): out-of-place here.
        for mod in model.modules():
            if isinstance(mod, nn.ReLU):
                mod.inplace = False
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    kind = "cuda" if cuda else "cpu"
    scaler = torch.amp.GradScaler(kind, enabled=(precision == "fp16"))
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(batch, 3, size, size, device=dev, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev, generator=g)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(kind, dtype=dtype, enabled=dtype is not None):
            loss = crit(forward(model, x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(cfg["warmup"]):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(cfg["steps"]):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    s = statistics.median(times)
    print(json.dumps(dict(s_per_step=s, img_per_s=batch / s,
                          peak_alloc=torch.cuda.max_memory_allocated() if cuda else None,
                          peak_reserved=torch.cuda.max_memory_reserved() if cuda else None)))


# ---------------------------------------------------------------- self-test

SAMPLE_STEP = """resnet50 (base width 64, ImageNet stem), 25557032 parameters, batch 8 at 64x64, 2 threads
saved activations (closed form): 52.94 MiB
plan keep[0..1] recompute[1..3] keep[3..18] at micro-batch 8, fp32; predicted peak 319.86 MiB
warm-up 1: loss 7.1256, 0.343 s
step 2: loss 6.3746, 0.305 s
system allocations per timed step: 1.0 (1.12 MiB); 542 of 543 requests served from the cache
median 0.037 s/step, 1735.40 img/s
tracked peak: 5.45 GiB (reserved now 6.00 GiB)
  category          at peak     own peak
  params          97.69 MiB    97.69 MiB
  data           384.00 KiB   384.00 KiB
process peak RSS: 606.07 MiB
predicted peak 5.43 GiB vs measured 5.45 GiB
"""

SAMPLE_MAX_BATCH = """resnet50 (base width 64), 224x224, SGD with momentum, budget 3.50 GiB: largest batch with no accumulation
| strategy | precision | largest batch | predicted peak | vs none fp32 |
|---|---|---|---|---|
| none | fp32 | 39 | 3.49 GiB | 1.00x |
| stages:layer1,layer2,layer4 | fp32 | 70 | 3.45 GiB | 1.79x |
| auto + BN+ReLU recompute | bf16 | 0 | - | 0.00x |
"""


def self_test():
    """Checks every parser and formatter on the samples above; an assert
    names the first that disagrees."""
    assert parse_size("123 B") == 123
    assert parse_size("12.34 KiB") == round(12.34 * KiB)
    assert parse_size("1.23 GiB") == round(1.23 * GiB)
    assert parse_size("3.5GiB") == 7 * GiB // 2
    assert parse_size("1861MiB") == 1861 * MiB
    for bad in ("12 MB", "GiB", "1.2.3 GiB", ""):
        try:
            parse_size(bad)
        except ValueError:
            continue
        raise AssertionError(f"parse_size accepted {bad!r}")

    v = parse_step(SAMPLE_STEP)
    assert v["s_per_step"] == 0.037 and v["img_per_s"] == 1735.40, v
    assert v["tracked_peak"] == round(5.45 * GiB) and v["reserved"] == 6 * GiB, v
    assert v["predicted_peak"] == round(5.43 * GiB), v
    assert v["plan"] == "keep[0..1] recompute[1..3] keep[3..18]" and v["micro_batch"] == 8, v
    assert v["precision"] == "fp32", v
    try:
        parse_step(SAMPLE_STEP.replace("median", "mean"))
        raise AssertionError("parse_step accepted output with no median line")
    except ValueError:
        pass

    rows = parse_max_batch(SAMPLE_MAX_BATCH + "\ntrailing text\n")
    assert [(r["strategy"], r["precision"], r["batch"]) for r in rows] == [
        ("none", "fp32", 39), (LAYERS, "fp32", 70), ("auto + BN+ReLU recompute", "bf16", 0)], rows
    assert rows[0]["predicted_peak"] == round(3.49 * GiB) and rows[2]["predicted_peak"] is None, rows
    try:
        parse_max_batch("no table\n")
        raise AssertionError("parse_max_batch accepted text with no table")
    except ValueError:
        pass
    assert parse_torch('warning\n{"img_per_s": 5.0}\n') == {"img_per_s": 5.0}

    # FACTS.md's fp32 line: 5584 MiB at 64, 82.8 MiB/img -> 287 MiB fixed, 39 under 3.5 GiB.
    slope, fixed = fit_line((32, (5584 - 32 * 82.8) * MiB), (64, 5584 * MiB))
    assert abs(slope / MiB - 82.8) < 1e-9 and abs(fixed / MiB - 284.8) < 1e-6, (slope, fixed)
    assert largest_batch(3584 * MiB, slope, fixed) == 39
    assert largest_batch(GiB, 0, 0) is None and largest_batch(MiB, MiB, 2 * MiB) == 0

    s = summarize([dict(values=dict(img_per_s=10.0, plan="p"), error=None),
                   dict(values=None, error="error: boom"), dict(values=dict(img_per_s=20.0, plan="q"), error=None)])
    assert s["img_per_s"] == 15.0 and s["plan"] == "p" and s["rounds"] == 2 and s["failed_rounds"] == ["error: boom"], s
    assert summarize([dict(values=None, error="error: x")]) == {"error": "error: x"}

    assert md_table(["a", "b"], [[1, "x|y"]]) == "| a | b |\n|---|---|\n| 1 | x\\|y |\n"
    assert fmt_mib(5584 * MiB) == "5584 MiB" and fmt_mib(None) == "n/a"
    assert fmt_ratio(1.8) == "1.80x" and fmt_ratio(None) == "n/a"
    assert cell({"error": "error: f16 not wired"}, None) == "error: f16 not wired"
    assert cell({"error": "timed out after 180 s"}, None) == "error: timed out after 180 s"
    row = speed_row("x", {"img_per_s": 900.0}, {"img_per_s": 1000.0})
    assert row[3] == "0.90x" and row[5] == "yes (floor 0.8)", row

    env = env_without_ld("/a:/b/")
    assert env_with_ld("/a:/b")["LD_LIBRARY_PATH"].startswith("/a:/b")
    assert "/b" not in env.get("LD_LIBRARY_PATH", "").split(":") and "/a" not in env.get("LD_LIBRARY_PATH", "").split(":")
    print("self-test passed")


# ---------------------------------------------------------------- main


class Stopped(Exception):
    """SIGTERM (check.sh's `timeout`) arrived: finish with what is done."""


def on_sigterm(signum, frame):
    # subprocess.run kills the run in flight as this propagates through it.
    raise Stopped(f"stopped by signal {signum}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--memfit", help="memfit binary (a CUDA build on the GPU machine)")
    ap.add_argument("--python", default=sys.executable, help="Python with torch and torchvision (default: this one)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu, for both tools (default cuda)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per configuration, alternating the tools (default 2)")
    ap.add_argument("--out", default=str(REPO / "target" / "gpu_vs_torch"), help="folder for raw.jsonl and table.md")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: " + ",".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="CPU-sized: 64x64, batches 4/8/16, 1 step, 1 round")
    ap.add_argument("--memfit-ld-library-path", default=MEMFIT_LD,
                    help="folders prepended to LD_LIBRARY_PATH for memfit and removed from it for torch")
    ap.add_argument("--timeout", type=float, default=180, help="seconds one run may take (default 180)")
    ap.add_argument("--max-batch-timeout", type=float, default=480,
                    help="seconds `memfit bench max-batch` may take, in the background (default 480)")
    ap.add_argument("--self-test", action="store_true", help="check the parsers on embedded samples and exit")
    ap.add_argument("--torch-worker", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.torch_worker:
        return torch_worker(json.loads(args.torch_worker))
    if args.self_test:
        return self_test()
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    if not args.memfit:
        ap.error("--memfit PATH is required (the memfit binary to compare)")
    if not os.access(args.memfit, os.X_OK):
        ap.error(f"--memfit {args.memfit}: not an executable file")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    Path(args.out).mkdir(parents=True, exist_ok=True)
    s = Settings(args.quick, args.rounds, args.device)
    b = Bench(args, s)
    versions = dict(memfit=memfit_identity(b), torch=torch_identity(b), nvidia_smi=gpu_identity(),
                    device=s.device, quick=args.quick, rounds=s.rounds, steps=s.steps, warmup=s.warmup,
                    image_size=s.image_size)
    b.raw.write(json.dumps(dict(side="versions", **versions)) + "\n")
    b.log(f"versions: {json.dumps(versions)}")

    def table(parts, state=None):
        """table.md as far as it goes: rewritten after each section, so a run
        cut short (a timeout's SIGTERM, see on_sigterm) keeps what it did;
        `state` says why it may be incomplete."""
        m, t = versions["memfit"], versions["torch"]
        header = (f"# memfit vs PyTorch on {t.get('gpu') or s.device}\n\n"
                  f"- memfit: {m['version']}, {m['path']}, sha256 {m['sha256'][:16]}\n"
                  f"- torch {t.get('torch')} (CUDA {t.get('cuda')}, cuDNN {t.get('cudnn')}), torchvision {t.get('torchvision')}\n"
                  f"- GPU: {versions['nvidia_smi']}\n"
                  f"- ResNet-50 {s.image_size}x{s.image_size}, steps {s.steps} after warm-up {s.warmup}, "
                  f"rounds {s.rounds}, device {s.device}{', quick' if args.quick else ''}; "
                  f"total {time.monotonic() - b.t0:.0f} s\n"
                  + (f"- **{state}**: only the sections below are finished\n" if state else "")
                  + "\n")
        text = header + "\n".join(parts)
        (Path(args.out) / "table.md").write_text(text)
        return text

    parts, stopped, runs = [], None, {}

    def section(name, make):
        """One section into `parts`; a crash in it (this script's own bug on
        output it never saw) is shown in its place and the next runs."""
        try:
            parts.append(make())
        except Stopped:
            raise
        except Exception:
            b.log(f"section {name} crashed:\n{traceback.format_exc()}")
            parts.append(f"## {name}: crashed\n\n```\n{traceback.format_exc()}```\n")
        table(parts, "still running (or killed) after these sections")

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if "maxbatch" in only:
            b.start_max_batch()
        if {"memory", "maxbatch"} & set(only):
            try:
                memory_runs(b, runs)
            except Stopped:
                raise
            except Exception:
                b.log(f"memory runs crashed:\n{traceback.format_exc()}")
        if "memory" in only:
            section("memory", lambda: section_memory(b, runs))
        if "maxbatch" in only:
            section("maxbatch", lambda: section_maxbatch(b, runs))
        if "auto" in only:
            section("auto", lambda: section_auto(b))
        if "speed" in only:
            section("speed", lambda: section_speed(b))
    except Stopped as e:
        stopped = str(e)
        b.log(f"{stopped}: writing the {len(parts)} finished section(s)")
        if "memory" in only and not parts and runs:
            # Stopped in the memory runs: the strategies done, as a section.
            try:
                parts.append(section_memory(b, runs).replace(
                    "\n\n", f" (stopped after {len(runs)} of {len(STRATEGIES)} strategies)\n\n", 1))
            except Exception:
                b.log(f"partial memory section crashed:\n{traceback.format_exc()}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        b.stop_max_batch()

    text = table(parts, stopped)
    b.raw.close()
    print(text)
    print(f"wrote {Path(args.out) / 'table.md'} and raw.jsonl", file=sys.stderr)
    return 1 if stopped else None


if __name__ == "__main__":
    sys.exit(main())
