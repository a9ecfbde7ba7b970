"""A small MoE decoder composed from the harness's stage subjects, served with tensor and
expert parallelism over the ranks of `group`.

Every rank holds the residual stream of every token of a forward (rows padded to a multiple
of the world size). Per layer:

    x = rmsnorm(h)                                   every rank, every token
    attention over this rank's heads (q/k/v and o projections: the `dense_gemm` subject;
    causal softmax attention in plain torch, each token against exactly its own prefix, so
    a token's bits do not depend on the batch or on prefill vs decode) -> a partial sum
    --tp_reduce--> this rank's rows; residual add
    MoE on this rank's rows: router (fp32 logits from float64, top-k) --dispatch--> expert
    GEMMs (`gemm`: gate-up, silu * up, down) --combine--> the routed output
    shared expert over this rank's slice of its intermediate (all-gathered rows) -> a partial
    sum --tp_reduce--> + the routed output (float32, rounded once) -> residual add
    all-gather of the new residual rows

then rmsnorm, the LM head (`dense_gemm`, bf16 logits) and log_softmax in float32.
`tp_reduce` is a collective subject, `dispatch` a dispatch subject (its combine too), `gemm`
and `dense_gemm` GEMM subjects, all by registered name in params (defaults: all_gather_fold,
torch_a2a_dispatch, torch_mm, torch_mm). A tracer (ep_harness.divergence) is told every op's
inputs and outputs per tracked token.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ep_harness.divergence import Op, rows_of
from ep_harness.contracts import DispatchConfig, GemmProblem, Served
from ep_harness.subject import register
from ep_harness.subjects.model.common import rmsnorm, shard_cols, shard_rows
from ep_harness.subjects.moe.composed import STAGES as MOE_STAGES
from ep_harness.subjects.moe.composed import Composed, ComposedMoE, route
from ep_harness.subjects.collective.common import all_gather_single

STAGES = (*MOE_STAGES, "dense_gemm")
BF16 = torch.bfloat16


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One token's attention over its prefix: q [n, d], k and v [t, n, d] contiguous ->
    [n * d] bf16. float32 throughout; the shapes depend on t alone."""
    scores = (q.float().unsqueeze(0) * k.float()).sum(-1) * q.shape[-1] ** -0.5  # [t, n]
    p = torch.softmax(scores, dim=0)
    return (p.unsqueeze(-1) * v.float()).sum(0).to(BF16).reshape(-1)


@register
class ComposedModel(Composed):
    name = "composed_model"
    family = "model"
    summary = "embedding + layers of (attention, TP reduce, MoE: router, dispatch, GEMMs, combine, TP reduce) + LM head"
    STAGES = STAGES

    def generate(self, prompts, score_from, new_tokens, weights, params, group, tracer):
        fwd = _Forward(self.stages(params), weights, params, group, tracer)
        seqs = [list(p) for p in prompts]
        want = [(s, j) for s, p in enumerate(seqs) for j in range(score_from[s] - 1, len(p))]
        rows = fwd.step([(s, j) for s, p in enumerate(seqs) for j in range(len(p))],
                        [t for p in seqs for t in p], want)
        logprobs = [[rows[key] for key in want if key[0] == s] for s in range(len(seqs))]
        generated = [[] for _ in seqs]
        for n in range(new_tokens):
            nxt = [int(torch.argmax(logprobs[s][-1])) for s in range(len(seqs))]
            for s, token in enumerate(nxt):
                generated[s].append(token)
            if n == new_tokens - 1:
                break
            step = []
            for s, token in enumerate(nxt):
                seqs[s].append(token)
                step.append((s, len(seqs[s]) - 1))
            rows = fwd.step(step, nxt, step)
            for s, key in enumerate(step):
                logprobs[s].append(rows[key])
        return Served([torch.stack(r) for r in logprobs], generated, fwd.routing)


class _Forward:
    """One served batch on one rank: its weight shards, KV cache and stage subjects."""

    def __init__(self, s: dict, weights: dict, params, group, tracer):  # params: the model family's
        self.s, self.w, self.p, self.group = s, weights, params, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.heads = params.heads // self.world
        self.head_dim = params.hidden // params.heads
        self.tracer = tracer
        self.cache: dict = {}  # (layer, slot) -> (k [t, n, d], v [t, n, d]) of this rank's heads
        self.routing: dict = {}
        r, w = self.rank, self.world
        self.shards = [{"wqkv": shard_rows(L["wqkv"], r, w, 3), "wo": shard_cols(L["wo"], r, w),
                        "shared_gate_up": shard_rows(L["shared_gate_up"], r, w, 2),
                        "shared_down": shard_cols(L["shared_down"], r, w)} for L in weights["layers"]]
        per_rank = params.num_experts // w
        self.experts = slice(r * per_rank, (r + 1) * per_rank)
        # The layout-size properties' forward (harness/families/layout.py): every TP product
        # per fixed virtual shard (heads / V heads, shared_intermediate / V columns), the same
        # GEMM operands at every world size; the shards reduced by the tp_reduce stage.
        self.virtual = list(_block(params, w, r)) if params.virtual_tp else []
        V = params.virtual_shards
        self.vshards = [[{"wqkv": shard_rows(L["wqkv"], v, V, 3), "wo": shard_cols(L["wo"], v, V),
                          "shared_gate_up": shard_rows(L["shared_gate_up"], v, V, 2),
                          "shared_down": shard_cols(L["shared_down"], v, V)} for v in self.virtual]
                        for L in weights["layers"]]

    # --- tracing: every op per tracked token; parts carry the rank where ranks hold different things
    def rec(self, op: Op, items: list, side: str, part: str, rows) -> None:
        if self.tracer is not None:
            self.tracer.record(op, items, side, part, rows)

    def dense(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((a.shape[0], b.shape[0]), dtype=BF16, device=a.device)
        self.s["dense_gemm"].run(GemmProblem("dense", a.contiguous(), b.contiguous(), [a.shape[0]], [0]), out)
        return out

    def step(self, tokens: list, ids: list, want: list) -> dict:
        """One forward over `tokens` ((slot, position) each, ids their token ids): the
        log-softmax row of every key in `want`."""
        w, dev = self.world, self.w["embed"].device
        real = len(tokens)
        padded = -(-real // w) * w
        names = [self.tracer.name(t) for t in tokens] if self.tracer else [None] * real
        items = names + [None] * (padded - real)
        h = torch.zeros((padded, self.p.hidden), dtype=BF16, device=dev)
        h[:real] = self.w["embed"][torch.tensor(ids, device=dev)]
        if self.rank == 0:
            op = Op((-1, 0), "embedding")
            self.rec(op, items, "in", "token", [torch.tensor([i]) for i in ids])
            self.rec(op, items, "out", "h", h)
        for layer in range(self.p.layers):
            h = self.layer(layer, h, tokens, items)
        at = {t: i for i, t in enumerate(tokens)}
        rows = torch.tensor([at[k] for k in want], device=dev)
        picked = [items[at[k]] for k in want]
        final = len(self.w["layers"])
        x = rmsnorm(h[rows], self.w["final_norm"])
        logits = self.dense(x, self.w["lm_head"])
        lp = torch.log_softmax(logits.float(), dim=-1)
        if self.rank == 0:
            for i, (stage, a, b) in enumerate((("final.norm", h[rows], x), ("lm_head", x, logits),
                                              ("log_softmax", logits, lp))):
                op = Op((final, i), stage, None, self.p.dense_gemm if stage == "lm_head" else None)
                self.rec(op, picked, "in", "x", a)
                self.rec(op, picked, "out", "y", b)
        lp = lp.cpu()
        return {k: lp[i] for i, k in enumerate(want)}

    def layer(self, l: int, h: torch.Tensor, tokens: list, items: list) -> torch.Tensor:
        L, S, r = self.w["layers"][l], self.shards[l], self.rank
        real, padded = len(tokens), h.shape[0]
        local = padded // self.world
        lo = r * local
        mine = items[lo:lo + local]
        ops = _layer_ops(l, self.p)
        if r == 0:  # the layer as one op: a token's output depends on its prefix's inputs
            self.rec(ops["layer"], items, "in", "h-prefix",
                     self._chains(("layer", l), tokens, items, h[:real]))

        x = rmsnorm(h, L["attn_norm"])
        if r == 0:  # every rank normalises every token alike; rank 0 speaks for them
            self.rec(ops["attention.norm"], items, "in", "h", h)
            self.rec(ops["attention.norm"], items, "out", "x", x)
        if self.virtual:
            qkv = self.virtual_qkv(l, x[:real], items, ops["qkv"])
        else:
            qkv = self.dense(x[:real], S["wqkv"])
            self.rec(ops["qkv"], items, "in", f"x@{r}", x[:real])
            self.rec(ops["qkv"], items, "out", f"rank {r}", qkv)
        o = self.attention(l, qkv, tokens, items, ops["attention"])
        if self.virtual:
            parts = self.virtual_partials(padded, [(o_v, V["wo"]) for o_v, V in zip(
                o.chunk(len(self.virtual), dim=1), self.vshards[l])], items, ops["o_proj"], "o")
            attn = self.tp_reduce_shards(parts, local, ops["attention.tp_reduce"], items, mine)
        else:
            partial = torch.zeros((padded, h.shape[1]), dtype=BF16, device=h.device)
            partial[:real] = self.dense(o, S["wo"])
            self.rec(ops["o_proj"], items, "in", f"o@{r}", o)
            self.rec(ops["o_proj"], items, "out", f"rank {r}", partial)
            attn = self.tp_reduce(partial, local, ops["attention.tp_reduce"], items, mine)
        h_mine = h[lo:lo + local] + attn
        self.rec(ops["attention.residual"], mine, "in", "h", h[lo:lo + local])
        self.rec(ops["attention.residual"], mine, "in", "attn", attn)
        self.rec(ops["attention.residual"], mine, "out", "h", h_mine)

        x_mine = rmsnorm(h_mine, L["moe_norm"])
        self.rec(ops["moe.norm"], mine, "in", "h", h_mine)
        self.rec(ops["moe.norm"], mine, "out", "x", x_mine)
        routed = self.moe(l, L, x_mine, tokens, items, lo, local, ops)
        x_all = torch.empty((padded, h.shape[1]), dtype=BF16, device=h.device)
        all_gather_single(x_all, x_mine.contiguous(), group=self.group)
        self.rec(ops["moe.gather"], mine, "in", "x", x_mine)
        self.rec(ops["moe.gather"], items, "out", f"rank {r}", x_all)
        if self.virtual:
            parts = self.virtual_partials(padded, [(_swiglu(self.dense(x_all[:real], V["shared_gate_up"])),
                                                    V["shared_down"]) for V in self.vshards[l]],
                                          items, ops["moe.shared"], "act")
            shared = self.tp_reduce_shards(parts, local, ops["moe.tp_reduce"], items, mine)
        else:
            act = _swiglu(self.dense(x_all[:real], S["shared_gate_up"]))
            partial = torch.zeros((padded, h.shape[1]), dtype=BF16, device=h.device)
            partial[:real] = self.dense(act, S["shared_down"])
            self.rec(ops["moe.shared"], items, "in", f"x@{r}", x_all[:real])
            self.rec(ops["moe.shared"], items, "out", f"rank {r}", partial)
            shared = self.tp_reduce(partial, local, ops["moe.tp_reduce"], items, mine)
        # the routed output joins after the reduction: added into one rank's partial instead,
        # its place in the sum would follow the token's rank, which follows the batch
        moe = (shared.float() + routed.float()).to(BF16)
        self.rec(ops["moe.residual"], mine, "in", "h", h_mine)
        h_mine = h_mine + moe
        self.rec(ops["moe.residual"], mine, "in", "shared", shared)
        self.rec(ops["moe.residual"], mine, "in", "routed", routed)
        self.rec(ops["moe.residual"], mine, "out", "h", h_mine)

        out = torch.empty_like(h)
        all_gather_single(out, h_mine.contiguous(), group=self.group)
        self.rec(ops["gather"], mine, "in", "h", h_mine)
        self.rec(ops["gather"], items, "out", f"rank {r}", out)
        if r == 0:
            self.rec(ops["layer"], items, "out", "h", out)
        return out

    def _chains(self, key, tokens, items, rows) -> list:
        """Prefix fingerprints of `rows` per sequence (tracked tokens only)."""
        out = [None] * len(tokens)
        if self.tracer is None or all(item is None for item in items):
            return out
        fps = rows_of(rows, [item is not None for item in items])
        for i, ((slot, _), fp) in enumerate(zip(tokens, fps)):
            if fp is not None:
                out[i] = self.tracer.chain((*key, slot), [fp])[0]
        return out

    def attention(self, l: int, qkv: torch.Tensor, tokens: list, items: list, op: Op) -> torch.Tensor:
        n, d, r = self.heads, self.head_dim, self.rank
        q, k, v = (qkv[:, i * n * d:(i + 1) * n * d].reshape(-1, n, d) for i in range(3))
        out = torch.empty((len(tokens), n * d), dtype=BF16, device=qkv.device)
        by_slot: dict = {}
        for i, (slot, pos) in enumerate(tokens):
            by_slot.setdefault(slot, []).append((i, pos))
        for slot, rows in by_slot.items():
            idx = torch.tensor([i for i, _ in rows], device=qkv.device)
            old_k, old_v = self.cache.get((l, slot), (k[:0], v[:0]))
            if old_k.shape[0] != rows[0][1]:
                raise RuntimeError(f"slot {slot} continues at position {rows[0][1]} but its cache holds "
                                   f"{old_k.shape[0]} tokens")
            ck, cv = torch.cat([old_k, k[idx]]).contiguous(), torch.cat([old_v, v[idx]]).contiguous()
            self.cache[(l, slot)] = (ck, cv)
            kv_fp = self._chains(("kv", l, r), [tokens[i] for i, _ in rows], [items[i] for i, _ in rows],
                                 torch.cat([k[idx], v[idx]], dim=1))
            for (i, pos), fp in zip(rows, kv_fp):
                out[i] = attend(q[i].contiguous(), ck[:pos + 1], cv[:pos + 1])
                if fp is not None:
                    self.rec(op, [items[i]], "in", f"q@{r}", q[i:i + 1])
                    self.rec(op, [items[i]], "in", f"kv-prefix@{r}", [fp])
        self.rec(op, items, "out", f"rank {r}", out)
        return out

    def experts_gemm(self, received, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The `gemm` subject over this rank's experts; a rank that received no row (a decode
        step of one prompt routes to k experts of E) skips the call: kernels need M > 0."""
        if a.numel() == 0:
            return torch.zeros((*a.shape[:-1], b.shape[1]), dtype=BF16, device=a.device)
        return ComposedMoE._gemm(self.s["gemm"], received, a, b)

    def virtual_qkv(self, l: int, x: torch.Tensor, items: list, op: Op) -> torch.Tensor:
        """q, k, v of this rank's heads from one product per virtual shard, laid out as the
        rank's own shard would give them ([q heads | k heads | v heads]). Parts are named by
        shard, so that traces at two world sizes compare."""
        per = [self.dense(x, V["wqkv"]).chunk(3, dim=1) for V in self.vshards[l]]
        if self.rank == 0:  # every rank multiplies the same x
            self.rec(op, items, "in", "x", x)
        for v, (q, k, val) in zip(self.virtual, per):
            self.rec(op, items, "out", f"shard {v}", torch.cat([q, k, val], dim=1))
        return torch.cat([torch.cat([p[i] for p in per], dim=1) for i in range(3)], dim=1)

    def virtual_partials(self, padded: int, products: list, items: list, op: Op, what: str) -> torch.Tensor:
        """[k, padded, H]: one row-parallel product per virtual shard of this rank (a, b)."""
        parts = []
        for v, (a, b) in zip(self.virtual, products):
            part = torch.zeros((padded, b.shape[0]), dtype=BF16, device=a.device)
            part[:a.shape[0]] = self.dense(a, b)
            self.rec(op, items, "in", f"{what} shard {v}", a)
            self.rec(op, items, "out", f"shard {v}", part)
            parts.append(part)
        return torch.stack(parts)

    def tp_reduce_shards(self, parts, local, op, items, mine) -> torch.Tensor:
        from ep_harness.shards import reduce_shards

        out = parts.new_empty((local, parts.shape[2]))
        reduce_shards(self.s["tp_reduce"], out, parts, [local] * self.world, self.group)
        for v, part in zip(self.virtual, parts):
            self.rec(op, items, "in", f"shard {v}", part)
        self.rec(op, mine, "out", "sum", out)
        return out

    def tp_reduce(self, partial, local, op, items, mine) -> torch.Tensor:
        out = partial.new_empty((local, partial.shape[1]))
        self.s["tp_reduce"].reduce_scatter(out, partial, [local] * self.world, self.group)
        self.rec(op, items, "in", f"rank {self.rank}", partial)
        self.rec(op, mine, "out", "sum", out)
        return out

    def moe(self, l, L, x, tokens, items, lo, local, ops) -> torch.Tensor:
        """The routed experts for this rank's rows (padding rows choose no expert)."""
        p = self.p
        mine = items[lo:lo + local]
        idx, wts = route(x, L["router"], p.topk, "softmax")
        pad = torch.arange(lo, lo + local, device=x.device) >= len(tokens)
        idx = torch.where(pad.unsqueeze(1), torch.full_like(idx, -1), idx)
        wts = torch.where(pad.unsqueeze(1), torch.zeros_like(wts), wts)
        for i in range(local):
            if lo + i < len(tokens):
                self.routing.setdefault(tokens[lo + i], []).append(idx[i].tolist())
        self.rec(ops["moe.router"], mine, "in", "x", x)
        self.rec(ops["moe.router"], mine, "out", "experts", idx)
        self.rec(ops["moe.router"], mine, "out", "weights", wts)
        cfg = DispatchConfig.of(p, expert_quant="bf16", wire="bf16", ue8m0=True, tokens_max=local, layer=l)
        received = self.s["dispatch"].dispatch(x, idx, wts, cfg, self.group)
        self.rec(ops["moe.dispatch"], mine, "in", "x", x)
        self.rec(ops["moe.dispatch"], mine, "in", "experts", idx)
        src = _sources(received, items, local)
        h = self.experts_gemm(received, received.x, L["gate_up"][self.experts])
        inter = L["down"].shape[-1]
        act = (torch.nn.functional.silu(h[..., :inter].float()) * h[..., inter:].float()).to(BF16)
        y = self.experts_gemm(received, act, L["down"][self.experts])
        flat = [t.reshape(-1, t.shape[-1]) for t in (received.x, h, act, y)]
        for (op, a, b) in ((ops["moe.dispatch"], None, flat[0]), (ops["moe.gate_up"], flat[0], flat[1]),
                           (ops["moe.act"], flat[1], flat[2]), (ops["moe.down"], flat[2], flat[3])):
            for slot, (rows, its) in src.items():
                if a is not None:
                    self.rec(op, its, "in", f"slot {slot}", a[rows])
                self.rec(op, its, "out", f"slot {slot}", b[rows])
        out = self.s["dispatch"].combine(y, received, wts, self.group)
        for slot, (rows, its) in src.items():
            self.rec(ops["moe.combine"], its, "in", f"slot {slot}", flat[3][rows])
        self.rec(ops["moe.combine"], mine, "in", "weights", wts)
        self.rec(ops["moe.combine"], mine, "out", "routed", out)
        return out


def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    inter = gu.shape[1] // 2
    return (torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(BF16)


def _block(params, world: int, rank: int) -> range:
    per = params.virtual_shards // world
    return range(rank * per, (rank + 1) * per)


def _sources(received, items: list, local: int) -> dict:
    """Per top-k slot: the received rows that carry it and their tokens' item names."""
    rank, token, slot = (t.tolist() for t in (received.src_rank, received.src_token, received.src_slot))
    out: dict = {}
    for row, (sr, st, ss) in enumerate(zip(rank, token, slot)):
        if sr >= 0 and items[sr * local + st] is not None:
            rows, its = out.setdefault(ss, ([], []))
            rows.append(row)
            its.append(items[sr * local + st])
    return out


def _layer_ops(l: int, p) -> dict:
    """The ops of layer l, in program order; the layer itself orders after its stages."""
    tp, disp, gemm, dense = p.tp_reduce, p.dispatch, p.gemm, p.dense_gemm
    stages = [("attention.norm", None, False), ("qkv", dense, False), ("attention", None, False), ("o_proj", dense, False),
              ("attention.tp_reduce", tp, True), ("attention.residual", None, False), ("moe.norm", None, False),
              ("moe.router", None, False), ("moe.dispatch", disp, True), ("moe.gate_up", gemm, False),
              ("moe.act", None, False), ("moe.down", gemm, False), ("moe.combine", disp, True),
              ("moe.gather", "all_gather_into_tensor", True), ("moe.shared", dense, False),
              ("moe.tp_reduce", tp, True), ("moe.residual", None, False),
              ("gather", "all_gather_into_tensor", True)]
    ops = {name: Op((l, i), name, l, subject, coll) for i, (name, subject, coll) in enumerate(stages)}
    ops["layer"] = Op((l, len(stages)), "layer", l)
    return ops
