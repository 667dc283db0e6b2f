"""Speculative expert reads in decode: the next `prefetch_depth` layers' experts guessed at layer l, their disk reads
started early.

Without it a decode step reads its few disk experts one layer at a time: layer l+1's reads start only after layer
l's experts ran and l+1's attention and routing did, so the disk waits for the GPU and the GPU for the disk. At
layer l the residual after l's attention exists already; layer l+d's own MoE input and router applied to it (the
model's functions, through the model interface and without the runner's routing hooks) guess l+d's choice, for
d = 1..D (D = `prefetch_depth`), as mixtral-offloading's speculative expert loading does (arXiv 2312.17238 §3.2:
the next layer's gate on the current hidden state). Why after l's attention and not after l's MoE: the MoE output
is ready only once l's experts have landed, too late to hide anything but l+1's attention, and its guess would need
a host sync of its own; the residual after attention is ready before l's routing sync, so the guesses ride to the
host on that sync (moe_step.RoutingSync: l's row counts and the D layers' guessed ids, one wait) and their reads overlap
l's experts and the next layers' attention. The residual stream changes little from one layer to the next in a
trained model, which is what makes the guess good (and worse the further ahead: D trades recall of the far layers
against wasted reads); hash-routed layers (deepseek4) route by token id, so their guess is exact.

Why deeper than one layer: a single expert read comes off the disk at ~80% of the deep rate (docs/benchmarks/
gpu-run22-readdepth), so what holds decode at ~half its disk bound is the disk standing idle between a layer's last
read and the next layer's first, not queue depth. Guessing D layers ahead keeps reads queued across that gap.

The guessed experts that sit on disk are read ahead (at read-ahead priority, in at most half the staging slots, in
layer order: the nearest layer first), after layer l's own demand reads have started, and without waiting for the
store's answer (read when a guessed layer is scored: a round trip per layer would cost about what a guess saves): in
the same message as layer l's loads when it has any (worker/moe_step.py), else as a prefetch of their own. A (layer,
expert) already asked for in this pass is not asked again (a layer guessed from
several earlier layers: the nearer guesses only add what the farther missed; the store also skips what it has
staged or in flight). Only WHEN bytes arrive changes: a guess is never used to compute (every layer routes itself
as always), so outputs are the same bits with it on or off, at any depth (invariant 1).

Reads ahead spend the disk on bytes that get used (the store's side: store/store.py; a demand read never waits behind
a guess there):
  drop      once a guessed layer is scored (its routing known), its guesses it does not use go to the store with that
            layer's own message (its load, or its read ahead; a prefetch of no keys when it sends neither): the store
            forgets those not started yet (ones started finish and stay staged, as any read ahead)
  budget    every guess is scored (hit = the layer used it), read ahead or not, per (guessed layer, depth d, class
            c): a hit rate online per attachment (counts halved past HIT_WINDOW guesses, so it follows the model's
            routing). Layer t's guesses of class c from d layers back are read ahead only while that hit rate is >=
            `prefetch_min_hit` (the first HIT_WARMUP guesses always are): a model whose guesses are poor does not
            flood the disk, and hash-routed layers (exact guesses) keep being read ahead however poor the others' are
  batch     a batched decode step (the lanes: T running rows, worker/lanes.py) guesses T rows' ids [T, D, k]; their
            union (up to T*k experts a layer) is mostly far, single-row guesses, each a whole expert read. So each
            guessed expert is classed by the rows that guessed it (Marks: rows [D, E], top [D, E]): `lone` (T = 1:
            all of a lone stream's guesses, the one class the budget had before: a lone stream reads ahead as it
            did), and in a batch `one` (one row, not its top-1), `top` (one row's top-1), `two`, `more` (>= 3 rows);
            the budget keeps a hit rate per class, so a class is held once it misses more than the budget allows.
            A batch's guesses of a layer are asked most rows first (then top-1 guesses), and capped: the reads ahead
            of layer t in one pass stop at the disk experts it is expected to read (a running mean of its disk
            experts in batched steps, DISK_DECAY: a read ahead past what the layer reads from disk must be waste,
            and under load the disk is what bounds the step), of which guesses from d layers back may fill
            (D - d + 1) / D (the far guesses are asked first; the nearer, better ones need room). Measured on a
            tiny skewed model, 8 rows, depth 3 (deploy/device/guess_waste.py --batch 8 --experts 64): hit rate one
            0.54-0.64, top 0.77-0.92, two 0.84-0.89, more 0.92-0.94; bytes read ahead and unused 5.7 -> 2.3 MB
            against the union, 4 rows 3.5 -> 1.8 MB. `prefetch_batch_rule = union` reads the union (one class, no
            cap: the rule before, kept for A/B runs)
  ranks     `prefetch_batch_rule = ranks` (for A/B runs; rows stays the default until a device measures it): the rows
            rule with a lone stream's one class split by each guessed expert's rank in its guessed top-k (the
            router's order, rank 1 its best score: Marks.rank): `lone-r1`, `lone-r2-3`, `lone-r4+` (RANK_FAR), each
            within the budget as any class, so a depth's low ranks are held while its top-1 keeps being read; the
            hash-routed layers (`exact`: guessed exactly) keep `lone`; a batch's classes are the rows rule's. Why:
            the low ranks of a guess miss most (8% of ds4-flash's exact decode's reads were guesses never used, hit
            rate 0.845 with one class a depth; gpu-run64/66). Hit rate by rank 1..6, lone, depth 3, ds4-wide
            (8 x 256 experts, top-6, synth; guessed on disk): depth 1 0.88 0.76 0.66 0.51 0.44 0.40, depth 2 0.69
            0.49 0.47 0.37 0.31 0.27, depth 3 0.52 0.38 0.33 0.32 0.26 0.16 (qwen3moe tiny, 64 experts top-4: 0.80
            0.69 0.45 0.40 at depth 1): the top-1 stands apart, ranks 2-3 sit near deepseek4's budget (0.7) at depth
            1, ranks 4..k under it at every depth. Measured on the CPU (docs/benchmarks/cpu-guess64, guess_waste.py
            --preset ds4-wide --rule rows,ranks, 768 lone steps): where the rows rule reads a depth in full (budget
            0.5: the device's regime), ranks reads 8% fewer bytes ahead, 13% fewer of them unused, for about the
            same recall (0.54 vs 0.55); where rows holds a depth whose top ranks beat the budget (0.7 on ds4-wide,
            whose depth 1 hits 0.65), ranks reads those: recall 0.26 -> 0.42 for 3.7x the unused bytes. The logits
            are the same bits under either rule (a guess never computes: tests/worker/test_decode_guess.py)

Counted per pass (PassStats), per guessed layer: guessed (its guessed experts on disk, all guesses of it together),
guess_hits (those the layer then used), guess_disk (the layer's disk experts), guess_bytes (reads started for its
guesses), guess_wasted_bytes (those reads that no demand load of the layer took: about, as a read ahead may still
serve a later token from its staged copy, and the store's answer counts a call's reads, not which of its keys; a read
the store dropped before it started counts here too: the store's own counters, readahead_bytes and readahead_used,
count the bytes read ahead and used), guess_held (guessed disk experts not read ahead: their (depth, class)'s hit rate
was below the budget, or past a batch's cap). Per (depth, class), never halved: Guesser.class_tries / class_hits /
class_read / class_unused_bytes (guessed on disk, used, read ahead, bytes read ahead that their layer did not use),
what guess_waste.py prints.

The depth D is `prefetch_depth`, or with it `auto` the architecture's own (its model class's guess_depth).
"""

from __future__ import annotations

import numpy as np
import torch

from betelgeuse.store.directory import TIER_DISK
from betelgeuse.worker.stats import PassStats


def guess_ahead(model, layer: int, x: torch.Tensor, token_ids: torch.Tensor, depth: int,
                n_layer: int, route=None) -> torch.Tensor | None:
    """x: the residual after layer `layer`'s attention (the model's form: [T,H], deepseek4 [T,hc,H]), token_ids [T]
    -> the guessed expert ids [T, D', k] int64 on the device (no sync) of layers layer+1 .. layer+D' (row-first, as
    every per-row tensor of a decode step: the lanes gather the running rows of all of them at once),
    D' = min(depth, n_layer - 1 - layer); None where D' = 0. Each is that layer's own routing on this residual
    (unhooked: a routing recorder or replayer sees only the real routing), all D' layers at once (model.guess_ids
    over router weights stacked at load). route(t, h, token_ids) -> ids [T, k]: an approximate routing mode's own
    choice for layer t (MoEStep.guess_route: `pool` over t's resident set), layer by layer on moe_input's h; None:
    exact routing's."""
    n = min(depth, n_layer - 1 - layer)
    if n <= 0:
        return None
    if route is not None:
        ids = [route(t, model.moe_input(t, x)[0], token_ids) for t in range(layer + 1, layer + 1 + n)]
        return ids[0].unsqueeze(1) if n == 1 else torch.stack(ids, dim=1)      # depth 1 (pool's): a view, no launch
    # the model's all-layers-at-once form: the ids guess_per_layer picks, in a few launches for all n layers
    return model.guess_ids(layer, x, token_ids, n)


def guess_per_layer(model, layer: int, x: torch.Tensor, token_ids: torch.Tensor, n: int) -> torch.Tensor:
    """What guess_ids must equal: layers layer+1 .. layer+n's own moe_input and (unhooked) route on x, one layer
    at a time -> ids [T, n, k] (the tests' reference; ~2-7 launches per layer on CUDA)."""
    guesses = []
    for t in range(layer + 1, layer + 1 + n):
        h, _ = model.moe_input(t, x)
        guesses.append(type(model).route(model, t, h, token_ids, None)[0])
    return torch.stack(guesses, dim=1)


class _Ask:
    """One prefetch call of guessed reads: its keys (nearest layer first) and the store's answer, read once."""

    __slots__ = ("keys", "answer", "n", "_per")

    def __init__(self, keys: list[tuple[int, int]], answer):
        self.keys, self.answer, self.n, self._per = keys, answer, None, None

    def queued_n(self) -> int:
        """Reads the call started (the store's answer; waited for on the first call)."""
        if self.n is None:
            self.n = self.answer()
        return self.n

    def queued(self, layer: int) -> int:
        """Reads started for `layer`'s keys: the store queues a call's keys in order until its read-ahead half of the
        staging slots is full, so the first n keys are taken as the n started (about: it also skips keys it has
        staged or in flight). Counted per layer once, at the first ask (each of the call's layers asks once, when
        it is scored: no list made a layer; issue 21, cpu-host62)."""
        per = self._per
        if per is None:
            per = self._per = {}
            for t, _ in self.keys[:self.queued_n()]:
                per[t] = per.get(t, 0) + 1
        return per.get(layer, 0)


class Marks:
    """A decode step's guesses of layers l+1 .. l+D, on the host: from their ids [T, D, k] (T running rows, each row's k
    ids best first: rank 0 is its top-1 guess), per depth d-1 and expert e, rows [D, E] = the running rows that
    guessed e, top [D, E] = those of them whose top-1 guess e is, rank [D, E] = the best rank a row guessed e at (k:
    none did); n = T. What the batch rule scores (module doc).
    From ids, rows, top and rank are counted when first read: a step whose guesses are all resident (decode's common
    case: on_disk, on the ids as Python lists: a few dozen, where each numpy call costs more than a loop over them)
    never needs them."""

    __slots__ = ("ids", "E", "n", "_rows", "_top", "_rank", "_held")

    def __init__(self, rows: np.ndarray, top: np.ndarray, n: int, rank: np.ndarray | None = None):
        self.ids, self.E, self.n, self._rows, self._top, self._rank, self._held = (None, rows.shape[1], n, rows, top,
                                                                                  rank, None)

    @classmethod
    def from_ids(cls, g: np.ndarray, E: int) -> "Marks":
        """g [T, D, k] int64 -> the marks (a row's k ids are distinct: +1 per row). The ids are kept as lists
        [T][D][k] (a copy: g may be a view of a buffer the next layer's sync rewrites)."""
        m = cls.__new__(cls)
        m.ids, m.E, m.n, m._rows, m._top, m._rank, m._held = g.tolist(), E, g.shape[0], None, None, None, None
        return m

    @property
    def depth(self) -> int:
        """D, the guessed layers' count (on the ids' lists where kept: no count made)."""
        return len(self.ids[0]) if self.ids else self.rows.shape[0]

    def _flat(self) -> np.ndarray:
        """The ids as [T, D, k] flat indices d * E + e into a [D, E] count."""
        g = np.array(self.ids, dtype=np.int64)
        return g + (np.arange(g.shape[1], dtype=np.int64) * self.E)[None, :, None]

    def _count(self):
        at, E = self._flat(), self.E
        T, D, k = at.shape
        self._rows = np.bincount(at.reshape(-1), minlength=D * E).astype(np.int64, copy=False).reshape(D, E)
        self._top = np.bincount(at[:, :, 0].reshape(-1), minlength=D * E).astype(np.int64, copy=False).reshape(D, E)
        for d, h in enumerate(self._held or ()):      # without(): the held experts' counts 0, as np.where makes them
            h = list(h)
            self._rows[d, h] = 0
            self._top[d, h] = 0

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:
            self._count()
        return self._rows

    @property
    def top(self) -> np.ndarray:
        if self._top is None:
            self._count()
        return self._top

    @property
    def rank(self) -> np.ndarray | None:
        """[D, E] (module doc; counted when first read: only the ranks rule's general path reads it); None where the
        marks were made from counts without it."""
        if self._rank is None and self.ids is not None:
            at = self._flat()
            T, D, k = at.shape
            rank = np.full(D * self.E, k, dtype=np.int64)
            np.minimum.at(rank, at.reshape(-1), np.broadcast_to(np.arange(k, dtype=np.int64), at.shape).reshape(-1))
            self._rank = rank.reshape(D, self.E)
        return self._rank

    def on_disk(self, first: int, layers, disk) -> bool:
        """Whether any expert guessed for these layers (ascending; `first` the layer of depth 1) is on disk: `disk`
        per layer the set of its experts on disk (a snapshot's: Guesser._disk)."""
        if self._rows is None:
            for t in layers:
                s = disk[t]
                if not s:
                    continue
                d = t - first
                h = None if self._held is None else self._held[d]
                for row in self.ids:
                    if not h:
                        if not s.isdisjoint(row[d]):
                            return True
                        continue
                    for x in row[d]:        # the few guessed ids, not a copy of the disk set less the held ones
                        if x in s and x not in h:
                            return True
            return False
        return any(disk[t] and not disk[t].isdisjoint(np.flatnonzero(self._rows[t - first]).tolist()) for t in layers)

    def without(self, held: np.ndarray) -> "Marks":
        """The marks less the experts `held` [D, E] bool marks (held elsewhere: no read needed). Marks on the ids'
        lists stay on them (decode's fast path, Guesser._candidates): the held experts kept per depth as sets (a few
        flex copies), their rows and top counted as 0 where counted; else (or held not [D, E]: broadcast as before)
        the counts with the held ones 0."""
        if self.ids and held.shape == (len(self.ids[0]), self.E):
            sets: list[set] = [set() for _ in range(held.shape[0])]
            for d, e in zip(*(x.tolist() for x in np.nonzero(held))):       # one numpy call for every depth
                sets[d].add(e)
            return self.without_sets(sets)
        return Marks(np.where(held, 0, self.rows), np.where(held, 0, self.top), self.n, self.rank)  # held: rows 0

    def without_sets(self, held: list[set]) -> "Marks":
        """without() on the ids' lists, `held` per depth the set of the held experts (copied: the caller's may
        change; MoEStep._unflexed passes FlexCache.copies)."""
        assert self.ids and len(held) == len(self.ids[0]), (len(held), self.ids and len(self.ids[0]))
        m = Marks.__new__(Marks)
        m.ids, m.E, m.n, m._rows, m._top, m._rank = self.ids, self.E, self.n, None, None, None
        m._held = list(map(set, held)) if self._held is None else [a | b for a, b in zip(held, self._held)]
        return m

    def classes(self, d: int, experts: np.ndarray, by_rank: bool = False) -> np.ndarray:
        """The batch rule's class of each of these experts guessed at depth d (1-based) -> [len] int (module doc);
        by_rank (the ranks rule): a lone stream's by their rank (rank_class), else all lone."""
        if self.n == 1:
            if not by_rank:
                return np.full(len(experts), LONE, dtype=np.int64)
            r = self.rank[d - 1][experts]
            return np.select([r == 0, r < RANK_FAR], [LONE_TOP, LONE_NEAR], LONE_FAR)
        r, t = self.rows[d - 1][experts], self.top[d - 1][experts]
        return np.select([r >= 3, r == 2, t > 0], [MORE, TWO, TOP], ONE)


# the hit-rate budget's classes of a guessed expert (module doc: batch rule): a lone stream's guesses (one running
# row: all its guesses, the class the budget always had); in a batch, an expert one row guessed not as its top-1,
# one row's top-1 guess, an expert two rows guessed, three or more; the ranks rule splits a lone stream's by their
# rank in its guessed top-k: top-1, ranks 2-3, ranks 4..k
LONE, ONE, TOP, TWO, MORE, LONE_TOP, LONE_NEAR, LONE_FAR = range(8)
CLASS_NAMES = ("lone", "one", "top", "two", "more", "lone-r1", "lone-r2-3", "lone-r4+")
RANK_FAR = 3        # the 0-based rank from which a lone stream's guess is LONE_FAR (module doc: measured per rank)
# prefetch_batch_rule: budgeted per class and capped (rows), the same with a lone stream's guesses by rank (ranks), or
# one class (union)
RULES = ("rows", "union", "ranks")


def rank_class(rank: int) -> int:
    """The ranks rule's class of a lone stream's guess at this 0-based rank (Marks.classes' by_rank, on a list)."""
    return LONE_TOP if rank == 0 else LONE_NEAR if rank < RANK_FAR else LONE_FAR


HIT_WARMUP = 8        # guesses of a (layer, depth, class) read ahead whatever their hit rate, before it is trusted
HIT_WINDOW = 256      # past this many guesses a (layer, depth, class)'s counts are halved: the rate follows routing
DISK_DECAY = 0.9      # the batch cap's running mean of a layer's disk experts: this much of the old mean per step


class Guesser:
    """The host side of one attachment's guesses: the guessed ids to the host with a layer's row counts, the reads
    ahead (each (layer, expert) asked once per pass, while its (depth, class)'s hit rate is within the budget, a batch's
    within the layer's cap), the drops of a scored layer's unused guesses, and the counts of hits and waste (module
    doc)."""

    __slots__ = ("session", "expert_bytes", "min_hit", "rule", "exact", "hits", "tries", "class_hits", "class_tries",
                 "class_read", "class_unused_bytes", "disk_mean", "fast", "_snap", "_disk_sets", "_stats", "_asked",
                 "_guessed", "_asks", "_pending", "_by_depth", "_batch", "_per_layer", "_hash", "_took")

    def __init__(self, session, n_layer: int, depth: int = 0, min_hit: float = 0.0, rule: str = "rows",
                 exact: int = 0):
        assert rule in RULES, rule
        self.session = session
        self.expert_bytes = [session.file.expert_nbytes(l) for l in range(n_layer)]   # one expert's disk bytes
        # exact: layers 0 .. exact-1 route by token id (deepseek4's hash layers): their guesses are exact, classed
        # as the rows rule classes them whatever the rule
        self.min_hit, self.rule, self.exact = min_hit, rule, exact
        D, C = max(depth, 1), len(CLASS_NAMES)
        # per (guessed layer, depth - 1, class): guessed disk experts the layer then used, of guessed (this
        # attachment; the budget's window)
        self.hits = np.zeros((n_layer, D, C), dtype=np.float64)
        self.tries = np.zeros((n_layer, D, C), dtype=np.float64)
        # per (depth - 1, class), never halved: guessed disk experts, those used, those read ahead (what a run
        # reports: deploy/device/guess_waste.py)
        self.class_hits = np.zeros((D, C), dtype=np.int64)
        self.class_tries = np.zeros((D, C), dtype=np.int64)
        self.class_read = np.zeros((D, C), dtype=np.int64)
        # per (depth - 1, class): the bytes read ahead that their layer then did not use (about, as guess_wasted_bytes)
        self.class_unused_bytes = np.zeros((D, C), dtype=np.int64)
        # per layer: the running mean of its disk experts in batched decode steps (the cap), NaN until one ran
        self.disk_mean = np.full(n_layer, np.nan)
        # read_ahead's short path where no guessed expert is on disk (False: the general one; MoEStep.fast)
        self.fast = True
        self._snap = self._disk_sets = None     # _disk's snapshot and its disk experts per layer
        self._stats = None                  # the pass the state below belongs to
        self._asked: set = set()            # (layer, expert) read ahead in this pass
        self._guessed: dict = {}            # guessed layer -> its guessed disk experts (set), all guesses of it
        self._asks: dict = {}               # guessed layer -> the _Asks holding its keys
        self._pending: list = []            # _Asks whose answer was not read yet
        self._by_depth: dict = {}           # guessed layer -> {depth: (guessed disk experts, budget classes, classes)}
        self._batch = False                 # this pass guesses for more than one running row
        self._per_layer: dict = {}          # guessed layer -> reads ahead asked for it in this pass
        self._hash = None                   # this pass's hash ahead: (its _Ask, layer -> experts asked), or None
        self._took: dict = {}               # guessed layer -> [(expert, depth - 1, class)] read ahead in this pass

    def _disk(self, snap) -> list[set]:
        """Per layer, the set of its experts on disk in the snapshot (Marks.on_disk), made once per snapshot (a
        decode's store pass keeps one across steps)."""
        if self._snap is not snap:
            self._snap, self._disk_sets = snap, [set(np.flatnonzero(row).tolist()) for row in snap["tier"] == TIER_DISK]
        return self._disk_sets

    def _pass(self, stats: PassStats):
        if self._stats is not stats:
            self._stats, self._asked, self._guessed, self._asks, self._pending, self._by_depth = (
                stats, set(), {}, {}, [], {})
            self._batch, self._per_layer, self._hash, self._took = False, {}, None, {}

    def hash_ahead(self, keys: list[tuple[int, int]], answer, stats: PassStats):
        """The step's hash-routed layers' disk experts `keys` were read ahead at its start (MoEStep.hash_ahead; answer()
        -> reads started): asked in this pass, so no guess asks them again unless the store did not start them (read
        with the pending answers at the next read ahead, as a guess's own). Counted on their layer's check."""
        self._pass(stats)
        ask = _Ask(keys, answer)
        self._asked.update(keys)
        self._pending.append(ask)
        by_layer: dict = {}
        for t, e in keys:
            by_layer.setdefault(t, set()).add(e)
        self._hash = (ask, by_layer)
        stats.hash_ahead += len(keys)

    def _hash_check(self, layer: int, disk: list[int], stats: PassStats):
        """check's part for a hash-read layer: the reads the store started (once per pass: all layers' keys, from the
        answer) and their bytes; the layer's keys it then used (exact routing: all of them)."""
        ask, by_layer = self._hash
        mine = by_layer.pop(layer, None)
        if mine is None:
            return
        stats.hash_ahead_hits += len(mine.intersection(disk))
        n = ask.queued(layer)
        stats.hash_ahead_started += n
        stats.hash_ahead_bytes += n * self.expert_bytes[layer]

    def worth(self, layer: int, depth: int, cls: int = LONE) -> bool:
        """Whether layer `layer`'s guesses of class `cls` from `depth` layers back are read ahead (module doc:
        budget)."""
        n = self.tries[layer, depth - 1, cls]
        return n < HIT_WARMUP or self.hits[layer, depth - 1, cls] >= self.min_hit * n

    def cap(self, layer: int, depth: int) -> int | None:
        """A batch's reads ahead of `layer` in one pass, once its guesses from `depth` layers back are asked: at most
        the disk experts it is expected to read (the running mean), of which the guesses from d layers back may fill
        (D - d + 1) / D (rounded up): the far guesses, asked first, leave room for the nearer, better ones. None: no
        batched step ran the layer yet, or the union rule."""
        m, D = self.disk_mean[layer], self.hits.shape[1]
        return None if self.rule == "union" or np.isnan(m) else int(np.ceil(m * (D - depth + 1) / D))

    def unused(self, layer: int, disk: list[int]) -> list[tuple[int, int]]:
        """Layer `layer` is scored and uses these disk experts (Python ints): the reads ahead asked for it in this pass
        that it does not use (for the store to drop where they have not started)."""
        if layer not in self._asks:
            return []
        used = set(disk)
        return list(dict.fromkeys([k for a in self._asks[layer] for k in a.keys if k[0] == layer and k[1] not in used]))

    def read_ahead(self, layer: int, layers, marks: Marks, snap, stats: PassStats, send=None, unheld=None):
        """Start the reads of the guessed experts that sit on disk of `layers` (ascending, each in layer+1 ..
        layer+D; marks of depths 1..D = layer+1 .. layer+D), nearest layer first, in one message: send(keys) -> a
        function answering the reads started (default: the store's prefetch; MoEStep puts them on layer `layer`'s own
        load message when it has one). A batch's experts of a layer go most rows first (then top-1 guesses), each
        (depth, class) within its hit-rate budget, the layer within its cap (union rule: one class, no cap); what this
        pass asked for already is not asked again, unless the store did not start it (its read-ahead half of the
        staging slots was full: the earlier calls' answers, sent a layer ago, are read here, as a guessed layer's
        score would). unheld(layer, marks) -> the marks less the experts held elsewhere (MoEStep._unflexed: flex
        copies), applied where
        a guessed expert sits on disk."""
        self._pass(stats)
        for ask in self._pending:
            self._asked.difference_update(ask.keys[ask.queued_n():])
        self._pending = []
        union, ranks = self.rule == "union", self.rule == "ranks"
        self._batch = self._batch or marks.n > 1
        disk = self._disk(snap) if self.fast else None     # once: the test below's and the candidates' (lists)
        if self.fast and layers and not marks.on_disk(layer + 1, layers, disk):
            # decode's common case: none of the guessed experts sits on disk: nothing to read ahead, hold or score;
            # the layers count as guessed (check counts their disk experts), as the loop below leaves them
            for t in layers:
                self._guessed.setdefault(t, set())
            return
        if unheld is not None:
            marks = unheld(layer, marks)
        keys = []
        lists = self.fast and marks.ids is not None       # the candidates on the ids' lists (_candidates)
        for t in layers:
            d, by_rank = t - layer, ranks and t >= self.exact
            if lists:
                e, kind = self._candidates(t, d, marks, disk[t], union, by_rank)
            else:
                e = np.nonzero(marks.rows[d - 1])[0]
                e = e[snap["tier"][t][e] == TIER_DISK]
                kind = marks.classes(d, e, by_rank)     # counted per class whatever the rule (class_*)
                cls = np.full(len(e), LONE, dtype=np.int64) if union else kind      # the budget's class
                self._by_depth.setdefault(t, {})[d] = (e, cls, kind)
                ok = np.array([self.worth(t, d, int(c)) for c in cls], dtype=bool)
                e, kind = e[ok], kind[ok]
                if not union and marks.n > 1:          # most rows first, then top-1 guesses; ties: ascending id
                    order = np.lexsort((e, -marks.top[d - 1][e], -marks.rows[d - 1][e]))
                    e, kind = e[order], kind[order]
            if lists and not e:                     # nothing to ask at this depth: what the lines below leave
                self._per_layer[t] = self._per_layer.get(t, 0)
                self._guessed.setdefault(t, set())
                continue
            cand = [(t, x) for x in e] if lists else [(t, int(x)) for x in e]     # _candidates': Python ints
            new = [k for k in cand if k not in self._asked]
            cap = self.cap(t, d) if marks.n > 1 else None
            if cap is not None:                     # past the cap: held, as below the budget
                new = new[:max(0, cap - self._per_layer.get(t, 0))]
            self._per_layer[t] = self._per_layer.get(t, 0) + len(new)
            took = set(new)
            # lists, not generators, here and below: a generator is a Python call a step (issue 21, cpu-host60)
            self._guessed.setdefault(t, set()).update([k[1] for k in cand if k in took or k in self._asked])
            if took:
                read: dict = {}                     # per class, then one numpy add each (not one per expert)
                mine = self._took.setdefault(t, [])     # check's class_unused_bytes
                for k, c in zip(cand, kind):
                    if k in took:
                        read[c] = read.get(c, 0) + 1
                        mine.append((k[1], d - 1, c))
                for c, n in read.items():
                    self.class_read[d - 1, c] += n
            keys += new
        if keys:
            self._asked.update(keys)
            # not waited for: the store's answer (reads started) is read when a guessed layer is scored
            ask = _Ask(keys, (send or self.session.prefetch_start)(keys))
            self._pending.append(ask)
            for t in dict.fromkeys([t for t, _ in keys]):
                self._asks.setdefault(t, []).append(ask)

    def _candidates(self, t: int, d: int, marks: "Marks", disk: set, union: bool, by_rank: bool) -> tuple[list, list]:
        """read_ahead's loop body for guessed layer t at depth d, on the ids' lists (a decode step guesses a few
        experts: a numpy call costs more than a Python step over them): the guessed experts on disk (`disk`: t's
        disk experts, Guesser._disk) ascending, their classes (by_rank: Marks.classes'), recorded for check as the
        general loop records them;
        -> (those within their (depth, class)'s budget, most rows first then top-1 guesses (ties: ascending id)
        where the batch rule orders them, their classes), as the general loop's e, kind."""
        ids = marks.ids
        # Marks.without's held experts need no read: the guessed ids tested against both sets (no copy of the
        # layer's disk set, ~130 of ds4-flash's 256 experts, less them)
        held = (marks._held[d - 1] if marks._held is not None else None) or ()
        if marks.n == 1:                    # the row's ids on disk, less the held: set operations (no comprehension)
            g = ids[0][d - 1]
            e = sorted(disk.intersection(g).difference(held))
            kind = [rank_class(g.index(x)) for x in e] if by_rank else [LONE] * len(e)
            rows = top = None
        else:
            rows, top = {}, {}
            for r in ids:
                g = r[d - 1]
                for x in g:
                    rows[x] = rows.get(x, 0) + 1
                top[g[0]] = top.get(g[0], 0) + 1
            e = sorted(x for x in rows if x in disk and x not in held)
            kind = [MORE if rows[x] >= 3 else TWO if rows[x] == 2 else TOP if x in top else ONE for x in e]
        cls = [LONE] * len(e) if union else kind
        # as lists (check's fast path scores them on lists: no array made and turned back)
        self._by_depth.setdefault(t, {})[d] = (e, cls, kind)
        if not e:                           # no guessed expert on disk at this depth (decode's usual depth)
            return e, kind
        worth: dict = {}                    # per class once (a lone stream's: one)
        px, pk = [], []
        for x, c, b in zip(e, kind, cls):
            y = worth.get(b)
            if y is None:
                y = worth[b] = self.worth(t, d, b)
            if y:
                px.append(x)
                pk.append(c)
        if not union and rows is not None and len(px) > 1:     # most rows first, then top-1 guesses, then the id
            order = sorted(range(len(px)), key=lambda i: (-rows[px[i]], -top.get(px[i], 0), px[i]))
            px, pk = [px[i] for i in order], [pk[i] for i in order]
        return px, pk

    def _score(self, layer: int, d: int, g: list, cls: list, kind: list, used: set):
        """check's counts for one depth's guesses of `layer` (g: guessed disk experts, cls: their budget classes, kind:
        their classes) as the general loop makes them, on lists: a decode layer's guesses are a few experts, and a
        numpy call costs more than a Python step over them."""
        hit = list(map(used.__contains__, g))      # x in used per guess (no comprehension: a call less a depth)
        n: dict = {}
        for c, y in zip(cls, hit):          # per budget class: guesses, hits
            t = n.setdefault(c, [0, 0])
            t[0] += 1
            t[1] += y
        tries, hits = self.tries[layer, d - 1], self.hits[layer, d - 1]
        for c, (k, h) in n.items():
            if tries[c] >= HIT_WINDOW:
                hits[c] /= 2
                tries[c] /= 2
            tries[c] += k
            if h:
                hits[c] += h
        per: dict = n if kind == cls else {}    # per class: [guesses, hits] (the budget's where the same classes)
        if per is not n:
            for c, y in zip(kind, hit):
                t = per.setdefault(c, [0, 0])
                t[0] += 1
                t[1] += y
        ct, ch = self.class_tries[d - 1], self.class_hits[d - 1]
        for c, (k, h) in per.items():
            ct[c] += k
            if h:
                ch[c] += h

    def check(self, layer: int, disk: list[int], ahead_used: int, stats: PassStats):
        """Layer `layer` ran with these disk experts (Python ints, as unused: every caller's are a list or tuple, so a
        set of them is one C call), `ahead_used` of them answered from reads ahead: score the guesses made for it in
        this pass, if any."""
        if self._stats is not stats:
            return
        if self._hash is not None:
            self._hash_check(layer, disk, stats)
        if self._batch:
            m = self.disk_mean[layer]
            self.disk_mean[layer] = len(disk) if np.isnan(m) else DISK_DECAY * m + (1 - DISK_DECAY) * len(disk)
        by_depth = self._by_depth.pop(layer, None)
        if self.fast and not by_depth and not len(disk) and layer not in self._asks:
            # no guessed expert of it on disk, none read ahead, none used: every count below would add 0
            self._guessed.pop(layer, None)
            return
        used, every = set(disk), set()
        for d, (g, cls, kind) in (by_depth or {}).items():     # every depth's guess scored, read or not
            if not len(g):                  # no guessed expert on disk from this depth: nothing to score
                continue
            if self.fast:                   # the same counts on the few guesses' lists (no numpy call per class)
                # _candidates' lists as they are, the general loop's arrays as lists
                gl, cl, kl = (g, cls, kind) if isinstance(g, list) else (g.tolist(), cls.tolist(), kind.tolist())
                self._score(layer, d, gl, cl, kl, used)
                every.update(gl)
                continue
            hit = np.array([int(x) in used for x in g], dtype=bool)
            for c in np.unique(cls):
                at = cls == c
                if self.tries[layer, d - 1, c] >= HIT_WINDOW:
                    self.hits[layer, d - 1, c] /= 2
                    self.tries[layer, d - 1, c] /= 2
                self.tries[layer, d - 1, c] += int(at.sum())
                self.hits[layer, d - 1, c] += int(hit[at].sum())
            np.add.at(self.class_tries[d - 1], kind, 1)
            np.add.at(self.class_hits[d - 1], kind[hit], 1)
            every.update(int(x) for x in g)
        took = self._took.pop(layer, None)
        if took:                            # the reads ahead of it it did not use, per (depth, class)
            for x, d, c in took:
                if x not in used:
                    self.class_unused_bytes[d, c] += self.expert_bytes[layer]
        guessed = self._guessed.pop(layer, None)
        stats.guess_held += len(every.difference(guessed or ()))
        asks = self._asks.pop(layer, ())
        if guessed is None:
            return
        queued = sum([a.queued(layer) for a in asks]) if asks else 0
        stats.guessed += len(guessed)
        stats.prefetched += queued
        stats.guess_bytes += queued * self.expert_bytes[layer]
        stats.guess_hits += len(guessed.intersection(used))
        stats.guess_disk += len(disk)
        stats.guess_wasted_bytes += max(0, queued - ahead_used) * self.expert_bytes[layer]
