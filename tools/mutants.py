"""The mutants `tools/mutate.py` runs: small, realistic slips in the code, each of which some test must catch.

A mutant is one exact text replacement (or a few) in one file, found by its text rather than its line, so that it
survives code moving around it; `mutate.py` reports it "stale" when an old string no longer occurs exactly once.
`tests` are the test files that must kill it (relative to the repository root; the killing one first, since
pytest stops at the first failure), `k` an optional `pytest -k` expression. A mutant known to survive says why in
`reason`, with `equivalent=True` when no test can tell it from the original (it then leaves the kill rate's
denominator).

M01-M34: the mutation audit of 7ae7111 (issue 44), with their numbers; the rest, one or more slips per public
function of manifold.py (F), optim.py (O, L), nn.py (A), convert.py (C) and _dtensor.py (D).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MUTANTS", "Mutant"]


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    edits: tuple[tuple[str, str], ...]  # (old, new): each old string must occur exactly once in the file
    description: str
    tests: tuple[str, ...]
    k: str | None = None  # a pytest -k expression
    reason: str | None = None  # why it survives, for a known survivor
    equivalent: bool = False  # no test can kill it: the same behaviour written otherwise


def _m(id, file, old, new, description, tests, k=None, reason=None, equivalent=False) -> Mutant:
    """One mutant of one edit; `tests` names files under tests/ without the folder ("optim" -> tests/test_optim.py)."""
    edits = tuple(old) if isinstance(old, list) else ((old, new),)
    paths = tuple(f"tests/test_{t}.py" for t in tests.split())
    return Mutant(id, file, edits, description, paths, k, reason, equivalent)


DT, OPT, NN, CONV = (f"src/stiefel_attention/{f}.py" for f in ("_dtensor", "optim", "nn", "convert"))
MAN = "src/stiefel_attention/manifold.py"
BENCH = "src/stiefel_attention/bench"

# fmt: off
MUTANTS: list[Mutant] = [
    # --- the audit of 7ae7111 -----------------------------------------------------------------------------------
    _m("M01", DT, "if placement.dim % p.dim() >= p.dim() - 2:", "if placement.dim % p.dim() > p.dim() - 2:",
       "frame_layout: a Shard on d read as LOCAL (>= -> >): Shard(1) frames stepped from a slice", "fsdp"),
    _m("M02", DT, "group=mesh.get_group(dim))", "group=mesh.get_group(0))",
       "all_reduce_over_mesh: every reduction over mesh dimension 0 (a 2-D mesh's shard dimension never reduced)",
       "mesh_reductions fsdp"),
    _m("M03", DT, "out.append(Shard(placement.dim % p.dim()))", "out.append(Replicate())",
       "_batch_placements: a batch-dim Shard of the per-frame second moment becomes Replicate", "fsdp"),
    _m("M04", OPT, "whole = p.full_tensor() if layout == GATHER else local", "whole = local",
       "_check_start: the local slice checked where the whole frame must be gathered", "fsdp"),
    _m("M05", OPT, "            self._write_back(write_backs)", "            pass",
       "step: gathered (Shard(1)) frames never written back to each rank's slice", "fsdp"),
    _m("M06", OPT, "for mesh in meshes:  # every rank of a sharded group decides alike",
       "for mesh in ():  # every rank of a sharded group decides alike",
       "_adamw_step, skip mode: the non-finite flag not all-reduced over the mesh", "mesh_reductions"),
    _m("M07", OPT, "else [g.isfinite().all(dim=(-2, -1)).reshape(-1) for g in batch.grads]",
       "else [g.isfinite().any(dim=(-2, -1)).reshape(-1) for g in batch.grads]",
       "skip mask (reference path): a frame kept if ANY gradient entry is finite", "optim"),
    _m("M08", OPT, "_START_TOLERANCE = 1e-3", "_START_TOLERANCE = 1e-2",
       "the start-point tolerance 10x looser", "mutants"),
    _m("M09", OPT, 'if saved["stiefel"] != mine["stiefel"]:', "if False:",
       "load_state_dict: the frame / AdamW group-split check removed", "reliability optim",
       k="state_dict"),
    _m("M10", OPT,
       "        if weight_decay != 0.0:\n            G = G + weight_decay * W\n"
       "        tangent.append(project_tangent(W, G) if projector else G)",
       "        tangent.append((project_tangent(W, G) if projector else G) + weight_decay * W)",
       "reference path: weight decay added after the tangent projection (it then acts on frames)", "optim"),
    _m("M11", OPT, "bc2 = 1.0 - torch.pow(beta2, t)", "bc2 = 1.0 - torch.pow(beta1, t)",
       "skip mode: the device bias correction of v uses beta1", "optim"),
    _m("M13", NN, "else c * torch.tanh(scaled / c)", "else torch.tanh(scaled / c)",
       "logit_softcap: c tanh(s / c) without its outer c", "logit_options"),
    _m("M14", NN, "device=device).triu(1)", "device=device).triu(2)",
       "causal mask off by one: a query sees the next key", "logit_options"),
    _m("M15", NN, 'torch.minimum(now["min"], self.logit_stats["min"])',
       'torch.maximum(now["min"], self.logit_stats["min"])',
       "track_logits: the running minimum folded with a maximum", "logit_options"),
    _m("M16", NN, "torch.sqrt(tau / s_max.clamp_min(tau))", "(tau / s_max.clamp_min(tau))",
       "qk_clip: each of W_Q, W_K scaled by tau / s_max instead of its square root", "logit_options"),
    _m("M18", CONV, [
        ("+ bk[:, None]).repeat_interleave(group, dim=1)\n        q_frame_part",
         "+ bk[:, None]).repeat(1, group, 1, 1)\n        q_frame_part"),
        ("(torch.einsum(\"bmd,gdr->bgmr\", xk, k_frame) + bk[:, None]).repeat_interleave(group, dim=1)",
         "(torch.einsum(\"bmd,gdr->bgmr\", xk, k_frame) + bk[:, None]).repeat(1, group, 1, 1)"),
    ], None, "calibrate under grouped-query attention: key heads tiled instead of grouped", "mutants"),
    _m("M19", CONV, "// (q_frame.shape[0] // k_frame.shape[0])", "% k_frame.shape[0]",
       "temperature under GQA: the key head of query head h is h % Hkv", "convert"),
    _m("M20", CONV, 'pieces = (("q", H), ("rest", H * r), ("k", H))', 'pieces = (("q", H), ("k", H), ("rest", H * r))',
       "CodeGen partitions read as q | k | v instead of q | v | k", "convert"),
    _m("M21", CONV, '(("q", H), ("rest", H * r)), r, interleaved=True)',
       '(("rest", H * r), ("q", H)), r, interleaved=True)',
       "gated q_proj (Qwen3-Next): each head's gate read before its queries", "convert"),
    _m("M22", CONV, "k_frame.copy_(qb @ vh.transpose(-2, -1))", "k_frame.copy_(qb @ vh)",
       "init='svd': the key frame takes Vh instead of V", "convert"),
    _m("M23", CONV, "target = q_old @ k_old.mT - bq[:, None] @ k_new.mT", "target = q_old @ k_old.mT",
       "calibrate: the query-bias term dropped from the least-squares target", "convert"),
    _m("M24", CONV, "module.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))",
       "module.__class__ = cls",
       "unstiefelize: no class of its own for a module before removing (a deep copy shares it)", "convert"),
    _m("M25", f"{BENCH}/grok/run.py", "            sched.load_state_dict(state)\n", "            pass\n",
       "grokking resume: the LR schedules' state not restored from the checkpoint", "grok"),
    _m("M26", f"{BENCH}/partial.py", 'if saved["key"] != self.key:', 'if saved["key"] is None:',
       "Checkpoint.load: only a key-less file refused (another run's checkpoint resumed)", "grok"),
    _m("M27", f"{BENCH}/lock.py", "same = os.fstat(fd).st_ino == os.stat(path).st_ino", "same = True",
       "Claims.claim: the inode re-check after locking removed", "mutants reliability", k="claim"),
    _m("M28", f"{BENCH}/records.py", "**self.config}, sort_keys=True, default=str)", "**self.config}, default=str)",
       "Cell.key: json.dumps without sort_keys (the key depends on the config's insertion order)",
       "experiments", k="committed_record"),
    _m("M29", f"{BENCH}/family.py", "sha == self.default_data_sha256 else", "sha != self.default_data_sha256 else",
       "Family.data_key: the comparison inverted (the default data keyed, other data not)", "reliability",
       k="default_corpus"),
    _m("M30", f"{BENCH}/report/summaries.py", "if arm in arms and done < total\n", "if done < total\n",
       "open_arms: waits for every open arm of the plan, not only the compared ones", "grok"),
    _m("M31", f"{BENCH}/report/stats.py", "* sd / math.sqrt(n)", "* sd / math.sqrt(n - 1)",
       "paired CI half-width: sd / sqrt(n - 1) instead of sd / sqrt(n)", "experiments",
       k="paired_comparison"),
    _m("M33", "src/stiefel_attention/certify.py",
       "for batched in (True, False):\n            ref = _run(lambda p: StiefelAdam(p, lr=0.05, batched=batched)",
       "for batched in (True,):\n            ref = _run(lambda p: StiefelAdam(p, lr=0.05, batched=batched)",
       "certify's weight-decay trajectory check steps the batched path only", "mutants certify"),
    _m("M34", "src/stiefel_attention/metrics.py", "/ sv[:, 0].square().clamp_min(", "/ sv[:, 0].clamp_min(",
       "stable rank: sum(sv^2) / sv_max instead of / sv_max^2", "metrics"),
    # --- manifold.py ------------------------------------------------------------------------------------------
    _m("F01", MAN, "return 0.5 * (A + A.mT)", "return A + A.mT", "sym: the 1/2 dropped", "manifold"),
    _m("F02", MAN, "return 0.5 * (A - A.mT)", "return 0.5 * (A.mT - A)", "skew: the sign flipped", "manifold"),
    _m("F03", MAN, "    if r < 1 or d < r:\n        raise ValueError(\n",
       "    if r < 1 or d <= r:\n        raise ValueError(\n",
       "check_frames: square frames (d = r) refused (off by one)", "manifold"),
    _m("F04", MAN, "return (G_ - W_ @ sym(W_.mT @ G_))", "return (G_ - W_ @ (W_.mT @ G_))",
       "project_tangent: G - W W^T G (sym dropped), not the tangent projection", "manifold"),
    _m("F05", MAN, "evals.clamp_min(tiny).rsqrt().unsqueeze(-2)", "evals.clamp_min(tiny).rsqrt().unsqueeze(-1)",
       "inv_sqrt_spd: the eigenvalue factors applied to rows instead of columns (wrong axis)", "manifold"),
    _m("F06", MAN, "coefs[-1] * -(2 * k - 1) / (2 * k)", "coefs[-1] * (2 * k - 1) / (2 * k)",
       "inv_sqrt_gram: the binomial series' alternating sign dropped", "manifold"),
    _m("F07", MAN, "if k < iters - 1:  # the last Y is never used", "if k < iters - 2:  # the last Y is never used",
       "inv_sqrt_gram, Newton-Schulz: the last used Y not updated (off by one)", "manifold"),
    _m("F08", MAN, "Y = W.to(cd) + xi.to(cd)", "Y = W.to(cd) - xi.to(cd)", "polar_retract: steps along -xi",
       "manifold"),
    _m("F09", MAN, "Q = Q * signs.unsqueeze(-2)", "Q = Q * signs.abs().unsqueeze(-2)",
       "random_frame: the sign fix of R's diagonal dropped (not Haar)", "manifold"),
    _m("F10", MAN, "torch.linalg.matrix_norm(W_.mT @ W_ - eye).max()",
       "torch.linalg.matrix_norm(W_.mT @ W_ - eye).mean()",
       "isometry_error: the mean over frames instead of the max", "manifold"),
    _m("F11", MAN, "return torch.linalg.matrix_norm(sym(W.detach()", "return torch.linalg.matrix_norm(skew(W.detach()",
       "tangent_error: the skew part measured instead of the symmetric one", "manifold"),
    _m("F12", MAN, "if rho ** (K + 1) / (1.0 - rho) <= tol:", "if rho ** (K + 1) * (1.0 - rho) <= tol:",
       "binomial_series_terms: the tail bound's 1 / (1 - rho) inverted (too few terms)", "manifold"),
    # --- optim.py ---------------------------------------------------------------------------------------------
    _m("O01", OPT, "(decay if p.dim() >= 2 and id(p) not in exempt", "(decay if p.dim() > 2 and id(p) not in exempt",
       "param_groups: matrices (2-D) not decayed (off by one)", "optim"),
    _m("O02", OPT, '{"params": plain, "weight_decay": 0.0, "stiefel": False}',
       '{"params": plain, "weight_decay": weight_decay, "stiefel": False}',
       "param_groups: biases and norm gains decayed", "optim"),
    _m("O03", OPT, 'frame_group["lr"] = frame_lr', 'frame_group["frame_lr"] = frame_lr',
       "param_groups: frame_lr stored under the wrong key (frames take the global lr)", "optim"),
    _m("O04", OPT, "return xi * (max_step / norm.clamp_min(torch.finfo(xi.dtype).tiny)).clamp(max=1.0)",
       "return xi * (max_step / norm.clamp_min(torch.finfo(xi.dtype).tiny))",
       "_cap (reference path): every step scaled to max_step, small ones enlarged", "optim"),
    _m("O05", OPT, "m.copy_(project_tangent(W, m))  # transport the old moment to W", "pass",
       "StiefelAdam reference path: the old first moment not transported to the new tangent space", "optim"),
    _m("O06", OPT, "alpha=1.0 - beta2)\n            denom = (v / bc2)",
       "alpha=1.0 - beta1)\n            denom = (v / bc2)",
       "StiefelAdam reference path: v's update weighted by 1 - beta1", "optim"),
    _m("O07", OPT, "xi = _cap(-lr * (m / bc1) / denom, max_step)", "xi = _cap(-lr * (m / bc2) / denom, max_step)",
       "StiefelAdam reference path: the first moment bias-corrected with beta2's correction", "optim"),
    _m("O08", OPT, "- torch.linalg.matrix_norm(sym(A)).square()", "- torch.linalg.matrix_norm(A).square()",
       "batched tangent norm: ||G||^2 - ||W^T G||^2 (sym dropped)", "optim"),
    _m("O09", OPT, "S = sym(B.mul_(beta).add_(A, alpha=dampening))", "S = B.mul_(beta).add_(A, alpha=dampening)",
       "batched moment update: the normal part removed with W^T m instead of sym(W^T m)", "optim"),
    _m("O10", OPT, "c.view(-1, 1, 1), value=-1.0, out=Y)", "c.view(-1, 1, 1), value=1.0, out=Y)",
       "batched retraction: W + c D instead of W - c D (uphill)", "optim"),
    _m("O11", OPT, "coefs.append((lr / bc1) / (v.reshape(-1) / bc2)", "coefs.append((lr / bc1) / (v.reshape(-1) / bc1)",
       "batched StiefelAdam (raise mode): v bias-corrected with beta1's correction", "optim"),
    _m("O12", OPT, "_frames_view(W), sym(A), alpha=-1.0, out=_frames_view(buf))",
       "_frames_view(W), sym(A), alpha=1.0, out=_frames_view(buf))",
       "batched StiefelSGD without momentum: G + W sym(W^T G) instead of its tangent part", "optim"),
    _m("O13", OPT, "buf.mul_(momentum).add_(g).copy_(project_tangent(W, buf))", "buf.mul_(momentum).add_(g)",
       "StiefelSGD reference path: the momentum not transported", "optim"),
    _m("O14", OPT, "ok.to(torch.float32), torch.distributed.ReduceOp.MIN, mesh)",
       "ok.to(torch.float32), torch.distributed.ReduceOp.MAX, mesh)",
       "raise mode under FSDP: the step refused only when every rank's gradient is non-finite", "fsdp"),
    _m("O15", OPT, "err.nan_to_num(nan=math.inf).to(p.device), torch.distributed.ReduceOp.MAX, mesh)",
       "err.nan_to_num(nan=math.inf).to(p.device), torch.distributed.ReduceOp.MIN, mesh)",
       "start check under FSDP: a frame refused only when every rank's shard is off the manifold", "fsdp"),
    _m("O16", OPT, "[sq.isfinite() for sq in p[1]]", "[~sq.isnan() for sq in p[1]]",
       "skip mask (batched path): a tangent norm of +inf passes (a finite gradient whose square overflows)",
       "mutants optim"),
    _m("O17", OPT, "torch.where(keep.view(keep.shape + (1,) * (new.dim() - keep.dim())), new, old, out=new)",
       "torch.where(keep.view(keep.shape + (1,) * (new.dim() - keep.dim())), old, new, out=new)",
       "_keep_where: the kept and the skipped frames swapped", "optim"),
    _m("O18", OPT, "torch.where(bad, old, now, out=now)", "torch.where(bad, now, old, out=now)",
       "AdamW groups, skip mode: a finite step undone and a non-finite one kept", "optim"),
    _m("O19", OPT, "step_bound = max_step\n", "step_bound = 0.1 * max_step\n",
       "batched retraction, skip mode: the inverse root sized for a tenth of max_step", "optim"),
    _m("L01", OPT, "m.sub_(W @ sym(W.mT @ m))  # transport to the current W", "pass",
       "LandingStiefelAdam: the first moment not transported to the current frame", "landing"),
    _m("L02", OPT, "W.add_(xi - 0.5 * (W @ E))", "W.add_(xi - W @ E)",
       "LandingStiefelAdam: the pull back towards St(d, r) without its 1/2 (no Newton-Schulz step)", "landing"),
    # --- nn.py ------------------------------------------------------------------------------------------------
    _m("A01", NN, "flat = w.permute(1, 0, 2).reshape(", "flat = w.permute(1, 2, 0).reshape(",
       "StiefelAttention._heads: the (D, H*r) matrix laid out head-minor (columns of the heads mixed)", "nn"),
    _m("A02", NN, "* (self.logit_scale / math.sqrt(self.head_dim))", "* (self.logit_scale / self.head_dim)",
       "explicit logits: q k^T / head_dim instead of / sqrt(head_dim)", "logit_options nn"),
    _m("A03", NN, "c * torch.sigmoid(t - math.log(c - 1.0))", "c * torch.sigmoid(t + math.log(c - 1.0))",
       "temperatures with max_temperature: the shift's sign flipped (not 1 at t = 0)", "bounded_logits nn"),
    _m("A04", NN, "cap * self.d_model / math.sqrt(self.head_dim)", "cap * math.sqrt(self.d_model / self.head_dim)",
       "logit_bound: sqrt(d_model / head_dim) instead of d_model / sqrt(head_dim)", "bounded_logits"),
    _m("A05", NN, "x.square().mean(dim=-1, keepdim=True) + eps", "x.square().sum(dim=-1, keepdim=True) + eps",
       "_rms_norm: divides by the norm instead of the RMS", "bounded_logits nn"),
    _m("A06", NN, "return x + self.mlp(self.ln2(x))", "return x + self.mlp(self.ln1(x))",
       "Block.forward: the MLP reads the attention's LayerNorm", "nn"),
    _m("A07", NN, "q, k = self._qk(x[:, -1:], x)", "q, k = self._qk(x[:, :1], x)",
       "forward_last: the first position's query instead of the last", "nn"),
    _m("A08", NN, 'modes = ("stiefel", "frozen") if include_frozen else ("stiefel",)', 'modes = ("stiefel", "frozen")',
       "frames(model): frozen frames always included", "nn optim"),
    _m("A09", NN, "if not self.causal or n_q == 1:", "if not self.causal:",
       "causal mask: a single (last) query masked as if it were the first", "nn logit_options"),
    _m("A10", NN, "wq, wk = self.w_q.detach() * self.logit_scale, self.w_k.detach()",
       "wq, wk = self.w_q.detach(), self.w_k.detach()", "bilinear_factors: logit_scale not folded in",
       "logit_options metrics"),
    _m("A11", NN, "original.view(m.n_heads, m.head_dim, m.d_model)", "original.view(m.head_dim, m.n_heads, m.d_model)",
       "qk_clip, linear layout: rows grouped head-minor", "logit_options"),
    # --- convert.py -------------------------------------------------------------------------------------------
    _m("C01", CONV, "blocks.append(t.transpose(1, 2).reshape(n * self.head_dim, self.d_model))",
       "blocks.append(t.reshape(n * self.head_dim, self.d_model))",
       "StiefelProjection.forward (nn.Linear rows): frames reshaped without the transpose", "convert"),
    _m("C02", CONV, "block.reshape(n, self.head_dim, self.d_model).transpose(1, 2)",
       "block.reshape(n, self.d_model, self.head_dim)",
       "StiefelProjection.heads (nn.Linear rows): a head's block read without the transpose", "convert"),
    _m("C03", CONV, "t = t * log_temperature.exp().to(t.dtype)", "t = t * log_temperature.to(t.dtype)",
       "temperature: the log-temperature used as the scale (exp dropped)", "convert"),
    _m("C04", CONV, "return (diff / norm) ** 0.5 if norm > 0", "return diff / norm if norm > 0",
       "qk_change (stiefelize_report): the squared relative change", "mutants convert"),
    _m("C05", CONV, "d=p.shape[-2], r=p.shape[-1], dtype=p.dtype", "d=p.shape[-1], r=p.shape[-2], dtype=p.dtype",
       "reset_frames: d and r swapped", "reliability", k="reset_frames"),
    _m("C06", CONV, "if p.head_dim > p.d_model:", "if p.head_dim >= p.d_model:",
       "stiefelize: square heads (head_dim = d_model) refused (off by one)", "mutants convert"),
    _m("C07", CONV, "model.eval()  # no dropout in the statistics", "pass  # no dropout in the statistics",
       "calibrate: run in training mode (dropout in the calibration inputs)", "mutants convert"),
    _m("C08", CONV, "scale = (pk[k_of] * pq.transpose(-2, -1)).sum((-2, -1)) / q_frame.shape[-1]",
       "scale = (pk[k_of] * pq.transpose(-2, -1)).sum((-2, -1)) / q_frame.shape[-2]",
       "temperature without calibrate: divided by d_model instead of head_dim", "convert"),
    _m("C09", CONV, "            if isinstance(hook, NormalisedInput):\n                del",
       "            if isinstance(hook, NormalisedInput) and False:\n                del",
       "unstiefelize: qk_input_norm's hooks left on the model", "convert"),
    _m("C10", CONV, "return (_rms_norm(args[0]), *args[1:])", "return (_rms_norm(args[0]),)",
       "qk_input_norm hook: the module's other arguments dropped", "mutants convert"),
    # --- _dtensor.py ------------------------------------------------------------------------------------------
    _m("D01", DT, "local_shape = p.shape[:-2] if gathered else local.shape[:-2]",
       "local_shape = local.shape[:-2] if gathered else p.shape[:-2]",
       "like_frames_batch: the second moment's local and global shapes swapped", "fsdp"),
    _m("D02", DT, "        if isinstance(placement, Replicate):\n            continue",
       "        if not isinstance(placement, Shard):\n            continue",
       "frame_layout: a Partial placement passes as Replicate (values not yet reduced are stepped)", "fsdp"),
]
# fmt: on
