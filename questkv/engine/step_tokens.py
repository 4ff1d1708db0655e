"""A step's sampled tokens: drawn from its logits, copied to the host, and kept on the device for the next step.

Under asynchronous scheduling a step is launched before the host holds the tokens of the step before: a row whose
input token is in flight reads it from :attr:`StepTokens.sampled`, at its sequence's row there
(:meth:`StepTokens.row_of`). After a step with lossless verify rows, a verify row's entry is the token after the
drafts it keeps (:func:`~questkv.engine.speculation.verified_next_inputs`: the choice that
:meth:`~questkv.engine.scheduler.Scheduler.update` makes on the host, made on the device) and
:attr:`StepTokens.kept_drafts` holds how many it kept, so that the next round's first draft can be launched before the
verify's update (its position, KV length and sampling index move by them). With tensor parallelism rank 0 samples and
broadcasts both; the other ranks take them with :meth:`StepTokens.follow`.
"""

from __future__ import annotations

from typing import Optional

import torch

from questkv.distributed.group import TensorParallel
from questkv.engine.sequence import Sequence
from questkv.engine.speculation import verified_next_inputs
from questkv.engine.step_data import SampledTokens, ScheduledBatch, StepLogprobs
from questkv.layers.sampler import Sampler


class StepTokens:
    """The sampler of a runner and the tokens of its latest step.

    Args:
        rows: the most sampling rows a step has (the largest padded batch).
        device: the runner's device.
        seed: the engine's seed (a request without its own draws with it, :meth:`Sequence.sampling_seed`).
        tp: the tensor-parallel group, or ``None`` on one device.
        max_queries: the most positions a row of a verify step has (``num_speculative_tokens + 1``; 1 without
            lossless decoding).

    Attributes:
        sampled: ``[rows]`` int64 on the device: the latest step's token per sampling row, in batch order (a verify
            row's next input).
        kept_drafts: ``[rows]`` int64 on the device: after a step with verify rows, the drafts each row kept (0 on
            the others); stale after any other step (only a row launched ahead of its verify reads it).
        greedy: ``[rows * max_queries]`` int64 on the device: the argmax of each logits row of the latest decode or
            verify step (:meth:`draw_greedy`).
        sampler: the :class:`~questkv.layers.sampler.Sampler`.
    """

    def __init__(self, rows: int, device: torch.device, seed: int, tp: Optional[TensorParallel] = None,
                 max_queries: int = 1) -> None:
        self.device, self.seed, self.tp = device, seed, tp
        self.sampler = Sampler()
        self.sampled = torch.zeros(rows, dtype=torch.int64, device=device)
        self.kept_drafts = torch.zeros(rows, dtype=torch.int64, device=device)
        self.greedy = torch.zeros(rows * max_queries, dtype=torch.int64, device=device)
        self._rows: dict[str, int] = {}
        pin = self._pin = device.type == "cuda"
        # Two pinned buffers, used in turn: a step's copy may still be queued when the next one is staged.
        self._host_tokens = [torch.zeros(rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._flip = 0

    def row_of(self, seq: Sequence) -> int:
        """The row of :attr:`sampled` that holds the latest step's token of ``seq`` (it sampled in that step)."""
        return self._rows[seq.request_id]

    def draw_greedy(self, logits: torch.Tensor, verify_inputs: Optional[torch.Tensor] = None) -> None:
        """In a decode or verify step's body (graph-capturable: device ops only), after its ``logits`` (``[n,
        vocab]`` float32): each row's argmax into :attr:`greedy` and the next step's inputs from them (a verify
        step's, ``verify_inputs`` as :meth:`sample` takes them: each row's next input and the drafts it keeps). A
        step whose sampling rows are all greedy then launches nothing after its graph but the copy to the host
        (:meth:`sample` with ``drawn``); any other step's sampling overwrites them."""
        count = logits.shape[0]
        tokens = self.greedy[:count]
        torch.argmax(logits, dim=-1, out=tokens)
        if verify_inputs is None:
            self.sampled[:count].copy_(tokens)
        else:
            self._keep(self._verified_next_inputs(tokens, verify_inputs))

    def sample(self, logits: torch.Tensor, batch: ScheduledBatch, verify_inputs: Optional[torch.Tensor] = None,
               drawn: bool = False) -> SampledTokens:
        """Sample the step's tokens from its ``logits`` (``[n, vocab]`` float32, one row per token sampled: a sampling
        row's one, a verify row's ``num_new_tokens``), keep them for the next step's inputs and launch their copy
        to the host (and that of the forced tokens' log-probabilities), without waiting for the device.
        ``verify_inputs``: a step of verify rows only, ``[rows, q_len]`` int64 on the device, each row's input tokens
        (its last verified token, then its drafts) as the step read them: its drafts are taken from there.
        ``drawn``: the step ran :meth:`draw_greedy` on these logits; where every sampling row is greedy (on one
        device) its tokens and next inputs are taken from there."""
        count = batch.num_sampled
        greedy = all(seq.sampling_params.temperature == 0 for seq in batch.seqs[:count])
        if drawn and greedy and self.tp is None:
            tokens = self.greedy[:logits.shape[0]]
        else:
            tokens = logits.argmax(dim=-1) if greedy else self._draw(logits, batch)  # [n] int64 on the device
            if self.tp is not None and count:
                tokens = self.tp.broadcast(tokens.contiguous())  # every rank's next inputs may read them
            if batch.num_verifies:
                self._keep(self._next_inputs(tokens, batch, verify_inputs))
            else:
                self.sampled[:count].copy_(tokens)
        self._rows = {seq.request_id: i for i, seq in enumerate(batch.seqs[:count])}
        flip = self._flip
        self._flip ^= 1
        if self._host_tokens[flip].shape[0] < tokens.shape[0]:
            self._host_tokens[flip] = torch.zeros(tokens.shape[0], dtype=torch.int64, pin_memory=self._pin)
        host = self._host_tokens[flip][:tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        logprobs = self._logprobs(logits, tokens, batch)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return SampledTokens(host, done, logprobs)

    def follow(self, count: int, rows: int, verifies: bool) -> None:
        """A rank other than 0: take the ``count`` tokens rank 0 broadcasts for a step of ``rows`` sampling rows
        (and, after a step with verify rows, ``verifies``, their next inputs and kept drafts)."""
        if not count:
            return
        tokens = self.tp.broadcast(torch.empty(count, dtype=torch.int64, device=self.device))
        if verifies:
            self._keep(self.tp.broadcast(torch.empty((2, rows), dtype=torch.int64, device=self.device)))
        else:
            self.sampled[:count].copy_(tokens)

    def _draw(self, logits: torch.Tensor, batch: ScheduledBatch) -> torch.Tensor:
        """The step's sampled tokens, ``[n]`` int64, for a batch with a row that samples (a greedy row takes its
        argmax). A request draws with its seed and the index of the output it samples, so a preempted and recomputed
        request draws as it would have, and a verify row draws at each position what a dense step there would: its
        draft steps drew with the same noise from Quest's logits, and a draft is kept where the two draws agree (a
        Gumbel coupling), so a lossless request's sampled output is the dense engine's, token for token, whatever it
        drafted."""
        params = [seq.sampling_params for seq in batch.seqs[:batch.num_sampled]]
        floats, ints = batch.sampling_rows(self.seed)
        floats = torch.tensor(floats, dtype=torch.float32).to(self.device, non_blocking=True)
        ints = torch.tensor(ints, dtype=torch.int64).to(self.device, non_blocking=True)
        ahead = [[row, self.row_of(batch.seqs[row])] for row, drafts in enumerate(batch.ahead) if drafts]
        if ahead:  # a row launched ahead of its verify samples the output after the drafts that verify kept
            rows, sources = torch.tensor(ahead, dtype=torch.int64).to(self.device, non_blocking=True).T
            ints[rows, 2] += self.kept_drafts[sources]
        filtering = any(p.top_k or p.top_p < 1 for p in params)  # else skip the sort
        return self.sampler(
            logits, floats[:, 0], ints[:, 0], floats[:, 1], ints[:, 1], ints[:, 2], apply_top_k_top_p=filtering
        )

    def _next_inputs(self, tokens: torch.Tensor, batch: ScheduledBatch, verify_inputs: Optional[torch.Tensor]
                     ) -> torch.Tensor:
        """Each sampling row's next input token and the drafts it kept (:func:`verified_next_inputs` over the step's
        sampled ``tokens``), ``[2, num_sampled]`` int64 on the device; with tensor parallelism broadcast from rank 0.
        The drafts: a verify-only step's ``verify_inputs`` (:meth:`sample`), else staged from the sequences, reading
        the tokens of the step before (a verify row's last draft may be in flight), so it runs before they are
        overwritten."""
        if verify_inputs is not None:
            next_inputs = self._verified_next_inputs(tokens, verify_inputs)
            return next_inputs if self.tp is None else self.tp.broadcast(next_inputs)
        count, verifies = batch.num_sampled, range(batch.num_decodes, batch.num_decodes + batch.num_verifies)
        width = max(batch.num_new_tokens[row] for row in verifies) - 1
        staged, flying, at = [], [], 0  # per row: its first token's index, then its drafts (-1 past them)
        for row, (seq, seq_len) in enumerate(zip(batch.seqs[:count], batch.seq_lens)):
            row_tokens, drafts = batch.num_sampled_tokens(row), []
            if row in verifies:
                ids, in_flight = seq.input_tokens(seq_len, row_tokens)
                drafts = ids[1:]
                if in_flight:  # its last draft, launched just before: [row, column, row of the sampled tokens]
                    flying.append([row, row_tokens - 1, self.row_of(seq)])
            staged.append([at, *drafts] + [-1] * (width - len(drafts)))
            at += row_tokens
        staged = torch.tensor(staged, dtype=torch.int64).to(self.device, non_blocking=True)
        if flying:
            rows, columns, sources = torch.tensor(flying, dtype=torch.int64).to(self.device, non_blocking=True).T
            staged[rows, columns] = self.sampled[sources]
        next_inputs = torch.stack(verified_next_inputs(tokens, staged[:, 0], staged[:, 1:]))
        return next_inputs if self.tp is None else self.tp.broadcast(next_inputs)

    def _verified_next_inputs(self, tokens: torch.Tensor, verify_inputs: torch.Tensor) -> torch.Tensor:
        """A verify-only step's ``[2, rows]`` next inputs and kept drafts (:func:`verified_next_inputs`) from its
        ``tokens`` (``[rows * q_len]`` int64, row after row) and ``verify_inputs`` (``[rows, q_len]``: each row's
        last verified token, then its drafts)."""
        rows, q_len = verify_inputs.shape
        offsets = torch.arange(rows, device=self.device) * q_len
        return torch.stack(verified_next_inputs(tokens, offsets, verify_inputs[:, 1:]))

    def _keep(self, next_inputs: torch.Tensor) -> None:
        """Keep a step's ``[2, rows]`` next inputs and kept drafts (:meth:`_next_inputs`) for the next step."""
        count = next_inputs.shape[1]
        self.sampled[:count].copy_(next_inputs[0])
        self.kept_drafts[:count].copy_(next_inputs[1])

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, batch: ScheduledBatch) -> Optional[StepLogprobs]:
        """Launch the copy to the host of the step's :class:`~questkv.engine.step_data.StepLogprobs` (from its
        ``logits``, ``[n, vocab]`` float32, and sampled ``tokens``, ``[n]`` int64, one row per sampled token); ``None``,
        and nothing launched, when no sampling row asks for log-probabilities or is at a forced output. Fresh host
        buffers each time: only such steps pay for them."""
        asked = [seq.sampling_params.logprobs for seq in batch.seqs[:batch.num_sampled]]
        targets = batch.forced_targets()
        if targets is None and all(n is None for n in asked):
            return None
        outputs = tokens
        if targets is not None:
            forced = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
            outputs = torch.where(forced >= 0, forced, tokens)
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
        chosen = log_probs.gather(1, outputs[:, None])  # [n, 1]
        rank = (log_probs > chosen).sum(dim=-1) + 1
        top = max((n for n in asked if n is not None), default=0)
        top_logprobs, top_ids = log_probs.topk(top, dim=-1)  # [n, top], most likely first
        return StepLogprobs(*map(self._to_host, (outputs, chosen[:, 0], rank, top_ids, top_logprobs)))

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` launched without waiting (into pinned memory on CUDA)."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
        return host.copy_(tensor, non_blocking=True)

    def tensors(self) -> list[torch.Tensor]:
        """Its device tensors (:meth:`ModelRunner.release` empties them)."""
        return [self.sampled, self.kept_drafts, self.greedy]
