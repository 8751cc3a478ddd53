"""What each layer of a model needs from the KV pool, learnt from mlx-lm itself.

`model.make_cache()` (mlx-lm's own per-layer caches) says each layer's kind: full
attention (`KVCache`), a sliding window (`RotatingKVCache`, its `max_size`), chunk-local
attention (`ChunkedKVCache`, its `chunk_size`). A probe forward through instrumented
copies of those caches then says how each layer attends: through mlx-lm's
`scaled_dot_product_attention` with exactly the keys and values its cache returned (the
pool can then be read by a kernel or a gather of our choosing), with attention sinks, or
by computing scores itself (Gemma 2's soft-capping, MLA's latent and RoPE parts), which
needs real dense K/V; whether a cache that keeps everything is attended through a window
mask (a sliding layer after all); whether the model's code reads a cache's `keys` /
`values` arrays (DeepSeek-V3.2's indexer: served dense K/V, as own-score layers are),
or anything else kiln's paged cache lacks (refused); and whether a recurrent state grows
with a request's first tokens (LongCat-Flash-Ngram's). Nothing here is keyed on a
model's name.
"""

from __future__ import annotations

import enum
import functools
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipc.process import CannotServe
from kiln_common import windows


class UnsupportedModelError(CannotServe, RuntimeError):
    """The model has a layer kind the engine cannot serve yet (the launcher's last line
    gives its message)."""


class Kind(enum.Enum):
    FULL = "full attention"
    SLIDING = "sliding window"
    CHUNKED = "chunked local attention"
    RECURRENT = "recurrent state"  # mlx-lm's ArraysCache: conv / SSM / linear-attention state


@dataclass(frozen=True)
class LayerKind:
    """One attention layer's kind and how its model code attends.

    span: SLIDING: positions a query sees, itself included (mlx-lm's max_size); CHUNKED:
    the chunk size (a query sees its own chunk up to itself); RECURRENT: how many state
    arrays the layer keeps (its ArraysCache's size). own_attention: the model
    computes scores from the cache's K/V itself, so decode hands it dense K/V, not the pool.
    latent (own attention too): at decode the model hands mlx-lm's attention the cache's
    keys as both keys and values, with scores it computed from the cache's values as the
    mask (MLA's absorbed decode: the latent, and the RoPE part's scores), so a kernel may
    attend the pool's keys with that mask as a bias (decode hands the model dense values
    only).
    """

    kind: Kind = Kind.FULL
    span: int = 0
    own_attention: bool = False
    sinks: bool = False
    latent: bool = False

    @property
    def windowed(self) -> bool:
        return self.kind in (Kind.SLIDING, Kind.CHUNKED)

    @property
    def recurrent(self) -> bool:
        return self.kind is Kind.RECURRENT

    @property
    def window(self) -> tuple[str, int]:
        """A windowed kind as kiln_common.windows names it: (kind, span)."""
        assert self.windowed
        return (windows.SLIDING if self.kind is Kind.SLIDING else windows.CHUNKED, self.span)

    def first_visible(self, lengths: Any) -> Any:
        """The first position a query at position lengths - 1 sees, for a numpy or an MLX
        array of lengths (operators only, so the MLX one stays in the graph)."""
        if not self.windowed:
            return lengths * 0
        return windows.first_visible(*self.window, lengths)

    def visible(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Whether a query at position q sees the key at position k (broadcast)."""
        return (k <= q) & (k >= self.first_visible(q + 1))

    def describe(self) -> str:
        what = self.kind.value + (f" {self.span}" if self.windowed else "")
        own = ", latent attention (its own RoPE scores)" if self.latent else (
            ", its own score math" if self.own_attention else "")
        return what + (", sinks" if self.sinks else "") + own


def cache_parts(caches: list[Any]) -> list[list[Any]]:
    """Each layer's caches: its one cache, or a CacheList's members (Falcon-H1 keeps a
    recurrent state and K/V in one layer; DeepSeek-V3.2 two K/V caches)."""
    from mlx_lm.models.cache import CacheList

    return [list(c.caches) if type(c) is CacheList else [c] for c in caches]


def kinds_from_caches(caches: list[Any]) -> list[LayerKind]:
    """The kind of every cache part (cache_parts, flattened in order) from mlx-lm's caches;
    refuses, naming every layer kind it cannot serve (with the layers that have it), any
    model with one."""
    kinds: list[LayerKind] = []
    unsupported: dict[str, list[int]] = {}
    for i, parts in enumerate(cache_parts(caches)):
        found = [_part_kind(c) for c in parts]
        if all(k is not None for k in found):
            kinds += found
        else:
            unsupported.setdefault(_cache_name(caches[i]), []).append(i)
    if unsupported:
        found = "; ".join(f"{_layers(ids)}: {name}" for name, ids in unsupported.items())
        raise UnsupportedModelError(f"{found}: not supported yet")
    return kinds


def _part_kind(cache: Any) -> LayerKind | None:
    from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache

    if type(cache) is KVCache:
        return LayerKind()
    if type(cache) is RotatingKVCache and cache.keep == 0:
        return LayerKind(Kind.SLIDING, int(cache.max_size))
    if type(cache) is ChunkedKVCache:
        return LayerKind(Kind.CHUNKED, int(cache.chunk_size))
    if type(cache) is ArraysCache:
        return LayerKind(Kind.RECURRENT, len(cache.cache))
    return None


def _cache_name(cache: Any) -> str:
    from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

    name = type(cache).__name__
    if isinstance(cache, RotatingKVCache):
        return f"{name} with keep={cache.keep} (sliding window keeping its first tokens)"
    if isinstance(cache, ArraysCache):
        return f"{name} (recurrent state)"
    if isinstance(cache, CacheList):
        parts = ", ".join(type(c).__name__ for c in cache.caches)
        return f"{name}({parts}) (several caches in one layer)"
    return name


def _layers(ids: list[int]) -> str:
    """'layer 5', 'layers 0-4, 6-10'."""
    return f"layer{'s' if len(ids) > 1 else ''} {_ranges(ids)}"


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


class ProbeRecorder:
    """Set while a probe forward runs: which caches' K/V reached the attention hook
    untouched, and which came with sinks (see install_attention_hook)."""

    current: "ProbeRecorder | None" = None

    def __init__(self) -> None:
        self.fetched: dict[int, tuple[Any, Any]] = {}  # id(cache) -> K/V it returned
        self.through_sdpa: set[int] = set()
        self.sinks: set[int] = set()
        self.latent: set[int] = set()  # keys as keys and values, a scores mask (LayerKind)
        self.query_heads: dict[int, int] = {}  # id(cache) -> the queries' heads there
        # What the pool cannot serve: the model's code reading from a cache what kiln's
        # served cache does not have (its arrays, Gemma 3n's shared K/V; id(cache) -> the
        # attribute).
        self.served: frozenset[str] = frozenset()  # what the served cache has (probe_layers)
        self.unserved_reads: dict[int, str] = {}
        # Caches whose `keys` / `values` arrays the model's code reads (DeepSeek-V3.2's
        # indexer and the MLA cache beside it): served dense K/V, as own-score layers.
        self.array_reads: set[int] = set()
        # Caches each of whose update_and_fetch calls passed one array as keys and values
        # (id -> whether every call did: DeepSeek-V3.2's indexer keys).
        self.same_kv: dict[int, bool] = {}
        # K/V a cache's keys_and_values returned (id(keys) -> id(cache)), and the caches
        # whose such K/V reached attention without them (AFM 7's reuse layers: their own
        # math reads the arrays' shapes, so such a cache hands out dense K/V).
        self.shared_kv: dict[int, int] = {}
        self.loose_kv: set[int] = set()
        # Masks a cache made for a window (id -> (window, the mask, kept so the id stays
        # its own)), and the window of each cache whose attention call got one.
        self.window_masks: dict[int, tuple[int, Any]] = {}
        self.windows: dict[int, int] = {}

    def saw_attention(self, cache: Any, queries: Any, keys: Any, values: Any,
                      sinks: Any, mask: Any = None) -> None:
        fetched = self.fetched.get(id(cache))
        if fetched is not None and fetched[0] is keys and fetched[1] is values:
            self.through_sdpa.add(id(cache))
            self.query_heads[id(cache)] = queries.shape[1]
        elif (fetched is not None and fetched[0] is keys and keys is values and sinks is None
              and _scores_mask(mask, queries, keys)):
            self.latent.add(id(cache))
        source = self.shared_kv.get(id(keys))
        if source is not None and source != id(cache):
            self.loose_kv.add(source)
        if mask is not None and id(mask) in self.window_masks:
            self.windows[id(cache)] = self.window_masks[id(mask)][0]
        if sinks is not None:
            self.sinks.add(id(cache))


def _scores_mask(mask: Any, queries: Any, keys: Any) -> bool:
    """Whether an attention call's mask is an additive score for each query head, query
    and key ([B, H, L, S] floats), as MLA's RoPE part is."""
    import mlx.core as mx

    return (isinstance(mask, mx.array) and mask.ndim == 4
            and mx.issubdtype(mask.dtype, mx.floating)
            and mask.shape == (queries.shape[0], queries.shape[1], queries.shape[2], keys.shape[2]))


def _probing(cache: Any, recorder: ProbeRecorder) -> Any:
    """mlx-lm's cache object, watched: what its update_and_fetch returned, the window
    masks its make_mask made, and reads by the model's own code of what kiln's served
    cache lacks (_watched)."""
    fetch = cache.update_and_fetch

    def update_and_fetch(keys: Any, values: Any) -> Any:
        out = fetch(keys, values)
        recorder.fetched[id(cache)] = out
        recorder.same_kv[id(cache)] = recorder.same_kv.get(id(cache), True) and keys is values
        return out

    cache.update_and_fetch = update_and_fetch
    make_mask = getattr(cache, "make_mask", None)  # not every cache class has one

    def windowed_make_mask(*args: Any, **kwargs: Any) -> Any:
        out = make_mask(*args, **kwargs)
        if kwargs.get("window_size") is not None and out is not None and not isinstance(out, str):
            recorder.window_masks[id(out)] = (int(kwargs["window_size"]), out)
        return out

    if make_mask is not None:
        cache.make_mask = windowed_make_mask
    shared = getattr(cache, "keys_and_values", None)

    def keys_and_values() -> Any:
        out = shared()
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.startswith(_CACHE_CODE):  # not its own update_and_fetch's call
            recorder.shared_kv[id(out[0])] = id(cache)
        return out

    if shared is not None:
        cache.keys_and_values = keys_and_values
    try:
        cache.__class__ = _watched(type(cache))
    except TypeError:  # a class whose instances cannot change class (slots): unwatched
        pass
    return cache


_ARRAYS = ("keys", "values")  # mlx-lm's KVCache arrays (PooledKVCache's: this forward's)

# Modules whose reads of a cache are not the model's: mlx-lm's cache code and its shared
# attention helpers, kiln's.
_CACHE_CODE = ("mlx_lm.models.cache", "mlx_lm.models.base", "worker_proc.")


@functools.cache
def _watched(cls: type) -> type:
    """`cls` noting, while a probe runs, reads by a model's own code of its `keys` /
    `values` arrays (ProbeRecorder.array_reads), and of what kiln's served cache does not
    have (ProbeRecorder.served: anything else of mlx-lm's cache classes)."""
    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
        # A hasattr probe of a name the cache lacks (mlx-lm's `bits`) raises here first.
        value = cls.__getattribute__(self, name)
        recorder = ProbeRecorder.current
        if recorder is not None and recorder.served and (name in _ARRAYS
                                                          or name not in recorder.served):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(_CACHE_CODE):
                return value
            if name in _ARRAYS:
                recorder.array_reads.add(id(self))
            else:
                recorder.unserved_reads.setdefault(id(self), name)
        return value

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})


@dataclass
class ProbedLayers:
    """What probe_layers learnt, per cache part (mlx-lm's order, CacheLists flattened).

    kinds: each part's LayerKind. parts: the parts themselves after the probe's tokens
    (their K/V or states give each one's shapes). lists: how many parts each layer's
    CacheList has (0: a plain cache; a CacheList of one cache is still indexed by the
    model). heads: each part's query heads at the attention hook (0 where its model
    computes scores itself). filling: recurrent parts whose arrays grew with the first
    tokens up to their shape, per array (LongCat-Flash-Ngram keeps its last n - 1 token
    ids): the pool keeps them full size, zeros in front until filled. values_are_keys:
    parts of layers with their own scores that store one array as keys and values
    (DeepSeek-V3.2's indexer keys): the pool keeps it once."""

    kinds: list[LayerKind]
    parts: list[Any]
    lists: list[int]
    heads: list[int]
    filling: dict[int, tuple[bool, ...]]
    values_are_keys: set[int]


# Decode tokens the probe runs at most while a recurrent state still grows.
_MOST_FILLING_TOKENS = 64


def probe_layers(model: Any) -> ProbedLayers:
    """Each cache part's kind and shapes (ProbedLayers): a one-token prompt, then one
    decode token (more while a recurrent state still grows), through mlx-lm's own caches,
    watched."""
    import mlx.core as mx
    from mlx_lm.models.cache import CacheList, make_prompt_cache

    from worker_proc.attention import PooledKVCache, install_attention_hook

    install_attention_hook()
    caches = make_prompt_cache(model)
    kinds = kinds_from_caches(caches)
    grouped = cache_parts(caches)
    parts = [c for group in grouped for c in group]
    recorder = ProbeRecorder()
    recorder.served = frozenset(dir(PooledKVCache))
    for cache, kind in zip(parts, kinds):
        if not kind.recurrent:  # a state is read and set, not fetched
            _probing(cache, recorder)
    states = [i for i, k in enumerate(kinds) if k.recurrent]
    ProbeRecorder.current = recorder
    try:
        model(mx.array([[0]]), cache=caches)
        first = _state_shapes(parts, states)
        recorder.through_sdpa.clear()  # judged on the decode token, as served
        recorder.latent.clear()
        model(mx.array([[0]]), cache=caches)
    finally:
        ProbeRecorder.current = None
    layer_of = [i for i, group in enumerate(grouped) for _ in group]
    filling = _fill_states(model, caches, parts, states, first, layer_of)
    mx.eval([c.state for c in parts])
    # A cache that keeps every position may still be attended through a window mask (one
    # a cache made for a window_size; mlx-lm's KVCache windows even one new token's mask):
    # that layer is a sliding one (Mistral 3's wrapper hands Ministral 3's sliding layers
    # plain KVCaches).
    kinds = [LayerKind(Kind.SLIDING, recorder.windows[id(c)])
             if k.kind is Kind.FULL and id(c) in recorder.windows else k
             for k, c in zip(kinds, parts)]
    # Own scores: no attention call with the cache's K/V, code reading its arrays, or other
    # layers attending its keys_and_values() without it (AFM 7's reuse layers place their
    # queries by the keys' count: dense K/V give each row's, run by length).
    dense = ({id(c) for c in parts if id(c) not in recorder.through_sdpa}
             | recorder.array_reads | recorder.loose_kv)
    probed = [k if k.recurrent else
              LayerKind(k.kind, k.span, own_attention=id(c) in dense,
                        sinks=id(c) in recorder.sinks,
                        latent=(id(c) in recorder.latent and not k.windowed
                                and id(c) not in recorder.array_reads | recorder.loose_kv))
              for k, c in zip(kinds, parts)]
    for i, k in enumerate(probed):
        if k.own_attention and k.windowed:
            raise UnsupportedModelError(
                f"layer {i}: {k.kind.value} whose scores the model computes itself")
    _refuse_unservable(recorder, layer_of, parts)
    heads = [0 if k.recurrent or k.own_attention else recorder.query_heads.get(id(c), 0)
             for k, c in zip(probed, parts)]
    lists = [len(group) if type(c) is CacheList else 0 for c, group in zip(caches, grouped)]
    same = {i for i, (k, c) in enumerate(zip(probed, parts))
            if k.own_attention and recorder.same_kv.get(id(c), False)}
    return ProbedLayers(probed, parts, lists, heads, filling, same)


def _state_shapes(parts: list[Any], states: list[int]) -> dict[int, list[tuple[int, ...]]]:
    return {i: [tuple(a.shape) if a is not None else () for a in parts[i].cache] for i in states}


def _fill_states(model: Any, caches: list[Any], parts: list[Any], states: list[int],
                 first: dict[int, list[tuple[int, ...]]],
                 layer_of: list[int]) -> dict[int, tuple[bool, ...]]:
    """Recurrent parts whose arrays grew from the prompt's token to the decode token
    (ProbedLayers.filling), decoded further until no state grows; refuses a model whose
    states still grow after _MOST_FILLING_TOKENS tokens (a state the size of the context)."""
    import mlx.core as mx

    shapes = _state_shapes(parts, states)
    grew = {i: tuple(a != b for a, b in zip(first[i], shapes[i])) for i in states}
    if not any(any(g) for g in grew.values()):
        return {}
    for _ in range(_MOST_FILLING_TOKENS):
        model(mx.array([[0]]), cache=caches)
        before, shapes = shapes, _state_shapes(parts, states)
        if before == shapes:
            return {i: g for i, g in grew.items() if any(g)}
        grew = {i: tuple(g or a != b for g, a, b in zip(grew[i], before[i], shapes[i]))
                for i in states}
    growing = sorted({layer_of[i] for i in states if any(grew[i])})
    raise UnsupportedModelError(
        f"{_layers(growing)}: a recurrent state that grows with the context: not supported yet")


def _refuse_unservable(recorder: ProbeRecorder, layer_of: list[int], parts: list[Any]) -> None:
    """Refuse, naming the layers (mlx-lm's cache entries; layer_of: each part's), a model
    whose code reads from its caches what the served cache lacks (anything of mlx-lm's
    cache classes but the K/V arrays: `nbytes`, `trim`, ...)."""
    read = [i for i, c in enumerate(parts) if id(c) in recorder.unserved_reads]
    if read:
        name = recorder.unserved_reads[id(parts[read[0]])]
        raise UnsupportedModelError(
            f"{_layers(sorted({layer_of[i] for i in read}))}: the model's code reads "
            f"`cache.{name}`, which kiln's paged cache does not have: not supported yet")


def describe_layers(descriptions: list[str]) -> str:
    """'layers 0-4, 6-10: sliding window 512; layers 5, 11: full attention', from each
    layer's description (LayerKind.describe, joined with ' + ' for a layer of several)."""
    groups: dict[str, list[int]] = {}
    for i, what in enumerate(descriptions):
        groups.setdefault(what, []).append(i)
    return "; ".join(f"{_layers(v)}: {name}" for name, v in groups.items())
