"""Scratch: K/V load cache hints in the Triton decode kernel, timed round-robin in one process.
Variants are the kernel module's source with the K/V loads' hints changed."""
import importlib.util, json, os, sys, time
import torch
from tknp_megatron.attention import triton_paged as tp, testing
from tknp_megatron import attention as attn
from tknp_megatron.tools.bench_attention import Timer, graph_replay

src = open(tp.load_kernels().__file__).read()
loads = [
    "k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=tok_ok[:, None] & d_ok[None, :], other=0.0",
    "v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=tok_ok[:, None] & d_ok[None, :], other=0.0",
    "k_hi = tl.load(k_ptr + k_off[:, None] + dh[None, :], mask=tok_ok[:, None] & dh_ok[None, :], other=0.0",
    "v_hi = tl.load(v_ptr + v_off[:, None] + dh[None, :], mask=tok_ok[:, None] & dh_ok[None, :], other=0.0",
]
for l in loads:
    assert src.count(l) == 1, l
HINTS = {"base": "", "ef": ', eviction_policy="evict_first"', "cg": ', cache_modifier=".cg"',
         "ef_cg": ', eviction_policy="evict_first", cache_modifier=".cg"'}
BLK = "blk = tl.load(bt_row + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)\n        slot = tok % PAGE"
assert src.count(BLK) == 1
CLAMP = ("tok_c = tl.minimum(tok, kv_hi - 1)  # a full tile's loads unmasked; past kv_hi: the last token again\n"
         "        blk = tl.load(bt_row + tok_c // PAGE).to(tl.int64)\n        slot = tok_c % PAGE")
def clamp(s, hint):
    s = s.replace(BLK, CLAMP)
    for l in loads[:2]:
        s = s.replace(l + hint + ")", l.split(", mask=")[0] + hint + ")")
    return s
HINTS["clamp"] = ""
HINTS["clamp_ef"] = ', eviction_policy="evict_first"'
mods = {}
for name, hint in HINTS.items():
    s = src
    for l in loads:
        s = s.replace(l, l + hint)
    if name.startswith("clamp"):
        s = clamp(s, hint)
    path = f"/tmp/tk_{name}.py"
    open(path, "w").write(s)
    spec = importlib.util.spec_from_file_location(f"tk_{name}", path)
    m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m)
    mods[name] = m
current = [mods["base"]]
tp.load_kernels = lambda: current[0]

dev = torch.device("cuda")
env = {"torch": torch}
timer = Timer(torch, dev, warmup=5, reps=int(os.environ.get("REPS", 30)), flush=True)
SHAPES = [(b, c, hq, hkv, d) for (hq, hkv, d) in [(8, 1, 128), (64, 8, 128), (12, 1, 192)]
          for (b, c) in [(32, 32768), (128, 4096), (128, 32768), (256, 4096), (8, 131072)]]
rows = []
for rnd in range(2):
    for (b, c, hq, hkv, d) in SHAPES:
        case = testing.make_paged_case([1] * b, [c] * b, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                       block_size=16, dtype=torch.bfloat16, device=dev, seed=b + c)
        backend = attn.get_backend("triton", dev)
        meta = backend.prepare(case.meta, attn.CallShape(hq, hkv, d, 16, case.q.dtype))
        qs = [case.q, torch.randn_like(case.q)]
        call = lambda q: backend(q, case.k_cache, case.v_cache, meta, case.scale)
        fns, outs = [], {}
        for name, m in mods.items():
            current[0] = m
            outs[name] = call(case.q).float()
            fns.append(graph_replay(env, call, qs))
        current[0] = mods["base"]
        ts = timer.interleaved(fns)
        err = {n: ((o - outs["base"]).norm() / outs["base"].norm()).item() for n, o in outs.items()}
        row = dict(round=rnd, B=b, ctx=c, hq=hq, hkv=hkv, d=d, **{f"{n}_us": t for n, t in zip(mods, ts)},
                   err=err, kv_gb=2 * b * c * hkv * d * 2 / 1e9)
        rows.append(row)
        print(f"r{rnd} B={b:4d} ctx={c:6d} {hq}/{hkv}/{d}: " + " ".join(
            f"{n} {t:8.1f}" for n, t in zip(mods, ts)) + "  ratios " + " ".join(
            f"{n} {t / ts[0]:.3f}" for n, t in zip(mods, ts)) + f"  max err {max(err.values()):.1e}", flush=True)
        del case, fns, outs, qs
        torch.cuda.empty_cache()
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(f"{out}/ef.json", "w"), indent=1)
