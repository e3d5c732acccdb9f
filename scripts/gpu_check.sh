#!/usr/bin/env bash
# gpu_check.sh: the GPU-only checks of the training runner, in one go (< 8 minutes).
#
# Run from anywhere on a machine with an NVIDIA GPU, a CUDA build of torch and this repo:
#     bash scripts/gpu_check.sh
# Stages (each one's failure is recorded in the JSON; the others still run):
#   1. environment: torch importable, CUDA visible, device name and capability
#   2. the tests marked `gpu` (pytest -m gpu)
#   3. a small transformer language model: fp32 vs bf16 autocast vs fp16 + GradScaler,
#      tokens/s and peak memory for each (synthetic tokens; the speed is what is measured)
#   4. a real `training.telemetry` snapshot, if training/telemetry.py exists
#   5. the runner's own cost: `training.loop.train` against a plain loop and the plain loop
#      with `loss.item()` every step (digits, bf16, batch 512, 3,000 steps, each whole call
#      timed, median of 5 alternating rounds; `python -m bench.runner_overhead gpu`), plus
#      each one's aten ops and host reads per step. Fails when the runner / plain ratio is
#      above 1.05; the ratio is also `runner_to_plain` at the top of the JSON.
# Figures go to one JSON: $OUT/gpu-check.json when $OUT is a directory, $OUT itself when it
# names a file, else ./gpu-check.json. Nothing is installed: a missing torch is reported.
# GPU_CHECK_ALLOW_CPU=1 runs stages 3 and 5 on the CPU, tiny, to check the script without
# a GPU.
set -u

cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
if [ -n "${OUT:-}" ]; then
    if [ -d "$OUT" ] || [ "${OUT%/}" != "$OUT" ]; then
        mkdir -p "$OUT"
        RESULT="${OUT%/}/gpu-check.json"
    else
        RESULT="$OUT"
    fi
else
    RESULT="$REPO/gpu-check.json"
fi
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x "$REPO/.venv/bin/python" ]; then
    PY="$REPO/.venv/bin/python"
else
    PY=$(command -v python3 || command -v python)
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)

# Each stage leaves $WORK/<stage>.json (its figures) and $WORK/<stage>.rc (its status).
stage() {  # stage NAME TIMEOUT_S CMD...
    local name=$1 limit=$2
    shift 2
    echo "== gpu_check: $name" >&2
    timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "$rc" >"$WORK/$name.rc"
    tail -n 5 "$WORK/$name.log" >&2
    return 0
}

# 1. environment ------------------------------------------------------------------------
cat >"$WORK/env.py" <<'EOF'
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
except Exception as e:  # reported, never installed here
    out["error"] = f"torch is not importable ({e}); install a CUDA build of torch 2.13"
    json.dump(out, open(sys.argv[1], "w")); sys.exit(1)
out["torch"] = torch.__version__
out["cuda_build"] = torch.version.cuda
out["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    out["device"] = torch.cuda.get_device_name(0)
    out["capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
    out["device_count"] = torch.cuda.device_count()
    out["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    from training.precision import choose_precision
    c = choose_precision("auto", torch.device("cuda", 0))
    out["auto_precision"] = c.precision
    out["auto_reason"] = c.reason
json.dump(out, open(sys.argv[1], "w"))
sys.exit(0 if out["cuda_available"] else 3)
EOF
stage env 60 "$PY" "$WORK/env.py" "$WORK/env.json"
TORCH_OK=1
if ! "$PY" -c 'import torch' 2>/dev/null; then
    TORCH_OK=0
    echo "gpu_check: torch is missing for $PY; install a CUDA torch first (not done here)" >&2
fi

# 2. gpu-marked tests -------------------------------------------------------------------
if [ "$TORCH_OK" = 1 ] && "$PY" -m pytest --version >/dev/null 2>&1; then
    stage tests 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
        --continue-on-collection-errors --junitxml="$WORK/tests.xml" tests
else
    echo "pytest or torch missing" >"$WORK/tests.log"
    echo 127 >"$WORK/tests.rc"
fi

# 3. transformer LM precision benchmark -------------------------------------------------
cat >"$WORK/lm.py" <<'EOF'
import json, math, os, sys, time
import torch
from torch import nn

cuda = torch.cuda.is_available()
if not cuda and os.environ.get("GPU_CHECK_ALLOW_CPU") != "1":
    json.dump({"error": "no CUDA device"}, open(sys.argv[1], "w")); sys.exit(3)
dev = torch.device("cuda" if cuda else "cpu")
tiny = not cuda
V, D, L, H, T, B = (512, 64, 2, 4, 32, 4) if tiny else (8192, 512, 6, 8, 512, 32)
WARM, STEPS = (2, 3) if tiny else (10, 40)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.zeros(T, D))
        layer = nn.TransformerEncoderLayer(D, H, 4 * D, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
        self.head = nn.Linear(D, V)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T), persistent=False)
    def forward(self, x):
        return self.head(self.body(self.emb(x) + self.pos, mask=self.mask, is_causal=True))

results = {"model": {"vocab": V, "d_model": D, "layers": L, "seq": T, "batch": B}, "device": str(dev)}
if cuda:
    results["device_name"] = torch.cuda.get_device_name(0)
    results["note"] = "fp32 with TF32 matmuls off (torch's default)"
for prec in ("fp32", "bf16", "fp16"):
    try:
        torch.manual_seed(0)
        if cuda:
            torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        model = LM().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
        scaler = torch.amp.GradScaler(dev.type, enabled=prec == "fp16")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(prec)
        data = torch.randint(0, V, (B, T + 1), device=dev)
        losses, skipped = [], 0
        for i in range(WARM + STEPS):
            if i == WARM:
                if cuda: torch.cuda.synchronize()
                t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                logits = model(data[:, :-1])
                loss = nn.functional.cross_entropy(logits.float().view(-1, V), data[:, 1:].reshape(-1))
            scaler.scale(loss).backward()
            before = scaler.get_scale() if scaler.is_enabled() else None
            scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)
            if before is not None and scaler.get_scale() < before: skipped += 1
            losses.append(loss.item())
        if cuda: torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        results[prec] = {
            "tokens_per_s": round(STEPS * B * T / dt, 1),
            "step_ms": round(1000 * dt / STEPS, 2),
            "peak_mem_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
            "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4),
            "finite": all(math.isfinite(x) for x in losses),
            "skipped_steps": skipped if prec == "fp16" else None,
        }
        del model, opt
    except Exception as e:
        results[prec] = {"error": f"{type(e).__name__}: {e}"}
base = results.get("fp32", {}).get("tokens_per_s")
for prec in ("bf16", "fp16"):
    if base and "tokens_per_s" in results.get(prec, {}):
        results[prec]["speedup_vs_fp32"] = round(results[prec]["tokens_per_s"] / base, 2)
json.dump(results, open(sys.argv[1], "w"), indent=1)
sys.exit(0 if all("error" not in results[p] for p in ("fp32", "bf16", "fp16")) else 1)
EOF
if [ "$TORCH_OK" = 1 ]; then
    stage lm 150 "$PY" "$WORK/lm.py" "$WORK/lm.json"
else
    echo 127 >"$WORK/lm.rc"
fi

# 4. telemetry snapshot (training/telemetry.py comes with a later issue) ------------------
if [ -f "$REPO/training/telemetry.py" ] && [ "$TORCH_OK" = 1 ]; then
    stage telemetry 60 "$PY" -m training.telemetry
else
    echo "training/telemetry.py not present yet" >"$WORK/telemetry.log"
    echo skipped >"$WORK/telemetry.rc"
fi

# 5. the runner's own cost against a plain loop ------------------------------------------
if [ "$TORCH_OK" = 1 ]; then
    ALLOW_CPU=()
    [ "${GPU_CHECK_ALLOW_CPU:-}" = 1 ] && ALLOW_CPU=(--allow-cpu)
    stage runner 420 "$PY" -m bench.runner_overhead gpu "$WORK/runner.json" "${ALLOW_CPU[@]}"
else
    echo 127 >"$WORK/runner.rc"
fi

# assemble ------------------------------------------------------------------------------
ELAPSED=$(( $(date +%s) - START ))
PY_JSON="$PY"
command -v "$PY_JSON" >/dev/null 2>&1 || PY_JSON=$(command -v python3)
"$PY_JSON" - "$WORK" "$RESULT" "$ELAPSED" <<'EOF'
import json, os, re, sys
work, result, elapsed = sys.argv[1], sys.argv[2], int(sys.argv[3])
def read(name, ext):
    try:
        return open(os.path.join(work, f"{name}.{ext}")).read()
    except OSError:
        return None
out = {"wall_s": elapsed, "stages": {}}
for name in ("env", "tests", "lm", "telemetry", "runner"):
    rc = (read(name, "rc") or "missing").strip()
    log = read(name, "log") or ""
    stage = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc, "ok": rc == "0"}
    if rc == "124":
        stage["error"] = "timed out"
    figures = read(name, "json")
    if figures:
        try:
            stage["figures"] = json.loads(figures)
        except ValueError:
            stage["raw"] = figures[-4000:]
    elif name == "telemetry" and log.strip():
        try:
            stage["figures"] = json.loads(log)
        except ValueError:
            stage["raw"] = log[-4000:]
    if name == "tests":
        m = re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", log)
        stage["counts"] = {k: int(v) for v, k in m}
    if not stage["ok"]:
        stage["log_tail"] = log.splitlines()[-25:]
    out["stages"][name] = stage
runner = out["stages"]["runner"].get("figures", {})
out["runner_to_plain"] = runner.get("ratio_runner_to_plain")
out["runner_to_plain_goal"] = runner.get("goal_ratio")
out["ok"] = all(s["ok"] or s["rc"] == "skipped" for s in out["stages"].values())
os.makedirs(os.path.dirname(os.path.abspath(result)), exist_ok=True)
with open(result, "w") as fh:
    json.dump(out, fh, indent=2)
print(json.dumps(out, indent=2))
print(f"gpu_check: wrote {result}", file=sys.stderr)
sys.exit(0 if out["ok"] else 1)
EOF
