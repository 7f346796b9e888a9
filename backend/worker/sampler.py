"""Pick the next token of every sequence from its logits (vLLM's semantics).

Order per step: structured-output mask → raw logprobs → min_tokens masking →
logit_bias → penalties → greedy argmax or temperature → top-k → top-p → min-p →
exponential-race sampling. Logprobs describe the model's raw distribution
(after the structured-output mask, as vLLM's), before any of the sampling
transforms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from tandem_kernels import ops as kernels
from backend.types.outputs import PositionLogprobs
from backend.types.sampling_params import SamplingParams
from backend.worker.logprobs import position_logprobs
from backend.worker.staged_upload import list_tensor

if TYPE_CHECKING:
    from backend.messages.grammar_mask import TokenBitmask
    from backend.worker.penalty_history import PenaltyHistory

_NEG_INF = float("-inf")
# Top-p first ranks only this many most likely tokens; wider nuclei fall back to a full sort.
_TOP_P_PREFIX = 1024


@dataclass(slots=True)
class SamplingRow:
    """One sequence that must produce a token this step.

    The token lists are the request's own lists, read but never modified.
    ``generator`` is the request's RNG (the runner creates it from
    ``params.seed`` on the logits' device and keeps it across steps).
    ``penalty_slot``: the sequence's row in the ``PenaltyHistory`` passed to the
    sampler (its prompt and outputs counted there); ``extra_history`` the tokens of
    ``output_token_ids`` beyond those outputs (the drafts before a draft row).
    Without a slot, penalties are computed from the token lists.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: Optional[int]
    generator: Optional[torch.Generator] = None
    penalty_slot: Optional[int] = None
    extra_history: Sequence[int] = ()
    # Outputs before this row's token, when ``output_token_ids`` may hold more (None: its length).
    num_output_tokens: Optional[int] = None

    @property
    def has_penalties(self) -> bool:
        return self.params.has_penalties

    @property
    def below_min_tokens(self) -> bool:
        count = len(self.output_token_ids) if self.num_output_tokens is None else self.num_output_tokens
        return count < self.params.min_tokens


@dataclass(slots=True)
class RowClasses:
    """Which rows of a batch each transform touches (``classify``). It depends on the rows'
    parameters and penalty slots alone, so a caller may pass it again with the same rows in
    later steps; ``uploads`` then keeps the per-row parameters uploaded the first time."""

    min_tokens: list[int]  # rows with a min_tokens (whether each is still short of it: per step)
    penalties: list[int]
    bias: list[int]
    random: list[int]
    logprobs: list[int]
    uploads: dict = field(default_factory=dict)


def classify(rows: list[SamplingRow]) -> RowClasses:
    """The ``RowClasses`` of ``rows``, in one pass."""
    classes = RowClasses([], [], [], [], [])
    for i, row in enumerate(rows):
        params = row.params
        if params.min_tokens:
            classes.min_tokens.append(i)
        if params.has_penalties:
            classes.penalties.append(i)
        if params.logit_bias:
            classes.bias.append(i)
        if not params.greedy:
            classes.random.append(i)
        if params.wants_logprobs:
            classes.logprobs.append(i)
    return classes


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[Optional[PositionLogprobs]]  # per row; None unless logprobs or logprob_token_ids is set


class Sampler:
    """Stateless: per-request state (tokens, RNG) comes in with the rows.

    ``upload`` sends host values to the logits' device: [(values, dtype)] -> tensors (the
    runner's pinned, non-blocking ``StagedUpload``, so sampling never waits for the device's
    queue; default: ``torch.tensor``)."""

    def __init__(self, upload: Optional[Callable[[list], list[torch.Tensor]]] = None) -> None:
        self.upload = upload

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 allowed_tokens: Optional[TokenBitmask] = None,
                 penalty_history: Optional[PenaltyHistory] = None,
                 classes: Optional[RowClasses] = None, count: bool = False) -> SamplerOutput:
        """logits: [num_rows, vocab], any float dtype; all math runs in float32.

        ``allowed_tokens`` (structured outputs) masks the other tokens of its rows
        first, in place: like vLLM, logprobs then describe the masked distribution.
        ``classes``: ``classify(rows)``, if the caller keeps it. ``count``: as
        ``sample_on_device``'s; not with logprob rows (their logprobs, computed after the
        count, could still fail).
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got shape {tuple(logits.shape)}.")
        if allowed_tokens is not None:
            allowed_tokens.apply_(logits)
        num_rows = len(rows)
        classes = classes or classify(rows)
        logprob_rows = classes.logprobs
        if count and logprob_rows:
            raise ValueError("count: only for a batch without logprob rows")
        raw_logprobs = None
        if logprob_rows:
            index = torch.tensor(logprob_rows, device=logits.device)
            raw_logprobs = logits[index].float().log_softmax(dim=-1)  # [num_logprob_rows, vocab]
        token_ids = self.sample_on_device(logits, rows, penalty_history, classes, count)

        logprobs: list[Optional[PositionLogprobs]] = [None] * num_rows
        if raw_logprobs is not None:
            chosen = token_ids[torch.tensor(logprob_rows, device=logits.device)]
            positions = position_logprobs(raw_logprobs, chosen, [rows[i].params.logprobs or 0 for i in logprob_rows],
                                           [rows[i].params.logprob_token_ids for i in logprob_rows])
            for i, position in zip(logprob_rows, positions):
                logprobs[i] = position
        return SamplerOutput(token_ids.tolist(), logprobs)

    def sample_on_device(self, logits: torch.Tensor, rows: list[SamplingRow],
                         penalty_history: Optional[PenaltyHistory] = None,
                         classes: Optional[RowClasses] = None, count: bool = False) -> torch.Tensor:
        """The rows' tokens [num_rows] int64, left on the logits' device (no logprobs, no
        grammar mask: ``__call__`` adds those). logits: [num_rows, vocab], not modified.
        ``classes``: ``classify(rows)``, if the caller keeps it. ``count``: also count each
        penalized row's token in ``penalty_history`` on the device, as the last thing done
        (rows one per sequence, each penalized row with its slot and no drafts before it)."""
        num_rows = len(rows)
        device = logits.device
        upload = self.upload or _direct_upload(device)
        classes = classes or classify(rows)
        min_tokens_rows = [i for i in classes.min_tokens if rows[i].below_min_tokens]
        penalty_rows, bias_rows, random_rows = classes.penalties, classes.bias, classes.random
        if not (min_tokens_rows or penalty_rows or bias_rows or random_rows):
            # Hot path: the argmax is the same in any dtype, so skip the float32 copy.
            return kernels.argmax_rows(logits)
        if not (min_tokens_rows or bias_rows or random_rows):
            # Greedy with penalties (each row's kept parameters): one kernel penalizes, picks and counts.
            args = _penalty_args(rows, penalty_rows, penalty_history, upload, classes.uploads)
            if args is not None:
                return _penalized_argmax(logits, penalty_history, args, count)

        work = logits.to(torch.float32, copy=True)  # [num_rows, vocab]; the caller's logits stay intact
        # Each transform's parameters go up through ``upload`` (on CUDA one non-blocking copy
        # that never waits for the device), so a deferred step never waits for the one before.
        if min_tokens_rows:
            _mask_stop_tokens(work, rows, min_tokens_rows, upload)
        if bias_rows:
            _add_logit_bias(work, rows, bias_rows, upload)
        if penalty_rows:
            _apply_penalties(work, rows, penalty_rows, penalty_history, upload, classes.uploads)

        if len(random_rows) == num_rows:
            token_ids = _sample_random(work, rows, upload)  # [num_rows]; filters our own copy in place
        else:
            token_ids = kernels.argmax_rows(work)  # [num_rows]; random rows overwritten below
            if random_rows:
                index, = upload([(random_rows, torch.int64)])
                token_ids[index] = _sample_random(work[index], [rows[i] for i in random_rows], upload)
        if count and penalty_rows:
            args = classes.uploads.get("penalties")  # made by _apply_penalties, for these rows
            if args is None:
                raise ValueError("count: every penalized row needs a history slot and no drafts")
            penalty_history.count(args[1], token_ids.index_select(0, args[0]))
        return token_ids


def _direct_upload(device: torch.device) -> Callable:
    """An ``upload`` without staging: each array copied to ``device`` on its own."""
    return lambda arrays: [list_tensor(values, dtype, device) for values, dtype in arrays]


def _mask_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow], row_indices: list[int],
                      upload: Callable) -> None:
    """min_tokens: rows still short of it cannot pick EOS or a stop token (in place).

    Like vLLM, EOS is masked even with ignore_eos. IDs outside the vocabulary
    can never be sampled, so they are skipped rather than indexed.
    """
    vocab_size = logits.shape[1]
    mask_rows: list[int] = []
    mask_tokens: list[int] = []
    for i in row_indices:
        row = rows[i]
        stop_ids = set(row.params.stop_token_ids)
        if row.eos_token_id is not None:
            stop_ids.add(row.eos_token_id)
        for token_id in stop_ids:
            if token_id < vocab_size:
                mask_rows.append(i)
                mask_tokens.append(token_id)
    if mask_rows:
        logits[tuple(upload([(mask_rows, torch.int64), (mask_tokens, torch.int64)]))] = _NEG_INF


def _add_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], row_indices: list[int],
                    upload: Callable) -> None:
    """Add each row's logit_bias to its logits (in place): one scatter for the batch."""
    index_rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for i in row_indices:
        row_tokens, row_values = rows[i].params.logit_bias_entries
        index_rows.extend([i] * len(row_tokens))
        tokens.extend(row_tokens)
        values.extend(row_values)
    index_t, tokens_t, values_t = upload([(index_rows, torch.int64), (tokens, torch.int64), (values, logits.dtype)])
    logits.index_put_((index_t, tokens_t), values_t, accumulate=True)


def _penalty_args(rows: list[SamplingRow], row_indices: list[int], history: Optional[PenaltyHistory],
                  upload: Callable, kept: Optional[dict]) -> Optional[tuple[torch.Tensor, ...]]:
    """The fused penalty kernels' row arguments, on the device: (rows, slots, repetition,
    frequency, presence), each [len(row_indices)]; taken from ``kept`` (``RowClasses.uploads``)
    if there, else uploaded and kept there. None where a row has no history slot or counts
    drafts (those rows take ``_apply_penalties``' other paths)."""
    args = kept.get("penalties") if kept is not None else None
    if args is not None or history is None:
        return args
    penalized = [rows[i] for i in row_indices]
    if any(row.penalty_slot is None or row.extra_history for row in penalized):
        return None
    f32 = torch.float32
    args = tuple(upload([(row_indices, torch.int64), ([row.penalty_slot for row in penalized], torch.int64),
                         ([row.params.repetition_penalty for row in penalized], f32),
                         ([row.params.frequency_penalty for row in penalized], f32),
                         ([row.params.presence_penalty for row in penalized], f32)]))
    if kept is not None:
        kept["penalties"] = args
    return args


def _penalized_argmax(logits: torch.Tensor, history: PenaltyHistory, args: tuple[torch.Tensor, ...],
                      count: bool) -> torch.Tensor:
    """Greedy tokens [num_rows] of logits [num_rows, vocab] (not modified) after the penalties of
    the rows in ``args`` (``_penalty_args``), counted in ``history`` if ``count``."""
    index, slots, repetition, frequency, presence = args
    return kernels.penalized_argmax(logits, index, history.prompt_seen, history.output_counts, slots,
                                    repetition, frequency, presence, count)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], row_indices: list[int],
                     history: Optional[PenaltyHistory] = None, upload: Optional[Callable] = None,
                     kept: Optional[dict] = None) -> None:
    """Repetition (prompt + output), frequency and presence (output) penalties, in place.

    With ``history`` (and every row's ``penalty_slot``) the counts come from it: O(rows x vocab)
    tensor work, one fused pass per row (``kernels.apply_penalties``) unless a row counts drafts;
    otherwise from the token lists, O(tokens) Python work (the reference). ``kept``
    (``RowClasses.uploads`` of these rows): the fused pass's row parameters, uploaded once."""
    device = logits.device
    args = _penalty_args(rows, row_indices, history, upload or _direct_upload(device), kept)
    if args is not None:
        index, slots, repetition, frequency, presence = args
        kernels.apply_penalties(logits, index, history.prompt_seen, history.output_counts, slots,
                                repetition, frequency, presence)
        return
    if history is not None and all(rows[i].penalty_slot is not None for i in row_indices):  # drafts counted
        index = torch.tensor(row_indices, device=device)
        sub = logits[index]  # [num_penalty_rows, vocab]
        need_seen = any(rows[i].params.repetition_penalty != 1.0 for i in row_indices)
        seen, counts = history.gather([rows[i].penalty_slot for i in row_indices],
                                      [rows[i].extra_history for i in row_indices], need_seen)
        logits[index] = _penalized(sub, rows, row_indices, seen, counts)
        return
    index = torch.tensor(row_indices, device=device)
    sub = logits[index]  # [num_penalty_rows, vocab]
    num_rows, vocab_size = len(row_indices), logits.shape[1]

    seen_rows: list[int] = []
    seen_tokens: list[int] = []
    output_rows: list[int] = []
    output_tokens: list[int] = []
    for j, i in enumerate(row_indices):
        row = rows[i]
        output = row.output_token_ids
        if row.params.repetition_penalty != 1.0:
            seen_rows.extend([j] * (len(row.prompt_token_ids) + len(output)))
            seen_tokens.extend(row.prompt_token_ids)
            seen_tokens.extend(output)
        if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0:
            output_rows.extend([j] * len(output))
            output_tokens.extend(output)

    seen = counts = None
    if seen_rows:
        seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        seen[torch.tensor(seen_rows, device=device), torch.tensor(seen_tokens, device=device)] = True
    if output_rows:
        counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        counts.index_put_(
            (torch.tensor(output_rows, device=device), torch.tensor(output_tokens, device=device)),
            torch.ones(len(output_rows), dtype=torch.float32, device=device),
            accumulate=True,
        )
    logits[index] = _penalized(sub, rows, row_indices, seen, counts)


def _penalized(sub: torch.Tensor, rows: list[SamplingRow], row_indices: list[int],
               seen: Optional[torch.Tensor], counts: Optional[torch.Tensor]) -> torch.Tensor:
    """``sub`` [n, vocab] with the penalties applied: ``seen`` [n, vocab] bool (prompt or output
    tokens, for the repetition penalty; None: no row has one), ``counts`` [n, vocab] float32
    (output token counts; None: no output tokens). Rows without a penalty are left unchanged,
    since their factor is 1 and their weights 0."""
    device = sub.device
    if seen is not None:
        penalty = torch.tensor(
            [rows[i].params.repetition_penalty for i in row_indices], dtype=torch.float32, device=device
        ).unsqueeze(1)  # [num_penalty_rows, 1]
        # HF/vLLM: shrink a seen token's logit towards zero (divide positive, multiply negative).
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen, penalized, sub)
    if counts is not None:
        frequency = torch.tensor(
            [rows[i].params.frequency_penalty for i in row_indices], dtype=torch.float32, device=device
        ).unsqueeze(1)  # [num_penalty_rows, 1]
        presence = torch.tensor(
            [rows[i].params.presence_penalty for i in row_indices], dtype=torch.float32, device=device
        ).unsqueeze(1)  # [num_penalty_rows, 1]
        sub = sub - frequency * counts - presence * (counts > 0).float()
    return sub


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow], upload) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one draw per row. logits: [n, vocab], modified.
    Without top-p it never waits for the device (its parameters go up through ``upload``)."""
    device = logits.device
    vocab_size = logits.shape[1]
    top_ks = [row.params.top_k if row.params.top_k < vocab_size else 0 for row in rows]  # 0: off
    min_ps = [row.params.min_p for row in rows]
    temperature, k, log_min_p = upload([([row.params.temperature for row in rows], torch.float32),
                                        (top_ks, torch.int64), (min_ps, torch.float32)])
    logits.div_(temperature.unsqueeze(1))

    if any(top_ks):
        _apply_top_k(logits, top_ks, k)

    top_p_rows = [i for i, row in enumerate(rows) if row.params.top_p < 1.0]
    if len(top_p_rows) == len(rows):
        _apply_top_p(logits, [row.params.top_p for row in rows])
    elif top_p_rows:
        index = torch.tensor(top_p_rows, device=device)
        subset = logits[index]  # [num_top_p_rows, vocab]
        _apply_top_p(subset, [rows[i].params.top_p for i in top_p_rows])
        logits[index] = subset

    if any(p > 0.0 for p in min_ps):
        # prob_i < min_p * prob_max  <=>  logit_i < logit_max + log(min_p); no softmax needed.
        log_min_p = log_min_p.log().unsqueeze(1)  # [n, 1]
        max_logit = logits.max(dim=-1, keepdim=True).values  # [n, 1]
        logits.masked_fill_(logits < max_logit + log_min_p, _NEG_INF)

    probs = logits.softmax(dim=-1)  # [n, vocab]
    return probs.div_(_exponential_noise(probs, rows)).argmax(dim=-1)


def _apply_top_k(logits: torch.Tensor, top_ks: list[int], k: torch.Tensor) -> None:
    """Keep the k largest logits per row (ties with the k-th kept); k = 0 keeps all. In place.
    k: top_ks [n] on the logits' device."""
    top_values = logits.topk(max(top_ks), dim=-1).values  # [n, max_k], descending
    kth = top_values.gather(1, (k - 1).clamp_min(0).unsqueeze(1))  # [n, 1]
    kth = torch.where(k.unsqueeze(1) > 0, kth, torch.full_like(kth, _NEG_INF))
    logits.masked_fill_(logits < kth, _NEG_INF)


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> None:
    """Keep per row the smallest most-likely set whose probability reaches top_p (in place).

    A token survives while the mass strictly before it is below top_p, so the
    top token always does. The nucleus usually lies among the few hundred most
    likely tokens, so those are ranked first (topk); only rows whose nucleus
    is wider pay for a full sort. The choice depends on the row alone, keeping
    seeded rows independent of the batch.
    """
    device = logits.device
    vocab_size = logits.shape[1]
    top_p = torch.tensor(top_ps, dtype=torch.float32, device=device).unsqueeze(1)  # [n, 1]
    probs = logits.softmax(dim=-1)  # [n, vocab]
    width = min(_TOP_P_PREFIX, vocab_size)
    prefix_probs, prefix_ids = probs.topk(width, dim=-1)  # [n, width] each, descending
    prefix_mass = prefix_probs.cumsum(dim=-1)  # [n, width]
    remove = torch.ones_like(logits, dtype=torch.bool).scatter_(1, prefix_ids, prefix_mass - prefix_probs >= top_p)

    if width < vocab_size:
        wide_rows = (prefix_mass[:, -1] < top_p[:, 0]).nonzero().squeeze(1)  # [num_wide]
        if wide_rows.numel():
            sorted_probs, sorted_ids = probs[wide_rows].sort(dim=-1, descending=True)  # [num_wide, vocab] each
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            remove[wide_rows] = torch.empty_like(sorted_ids, dtype=torch.bool).scatter_(
                1, sorted_ids, mass_before >= top_p[wide_rows]
            )
    logits.masked_fill_(remove, _NEG_INF)


def _exponential_noise(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Exp(1) noise [n, vocab]; argmax(probs / noise) is a draw from probs.

    A seeded row draws only from its own generator, so its tokens do not depend
    on the rest of the batch; unseeded rows share the global RNG. Drawn as
    -log(uniform): the same distribution as ``exponential_``, which is several
    times slower on CPU.
    """
    noise = torch.empty_like(probs)
    seeded = [i for i, row in enumerate(rows) if row.generator is not None]
    if len(seeded) < len(rows):
        noise.uniform_()
    for i in seeded:
        noise[i].uniform_(generator=rows[i].generator)
    # A zero (uniform = 1 on some devices) would turn a filtered-out token's 0/0 into NaN, which argmax picks.
    return noise.log_().neg_().clamp_min_(torch.finfo(noise.dtype).tiny)
