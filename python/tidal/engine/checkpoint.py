"""Checkpoints and state dicts of an Engine, streamed chunk slot by slot.

Note [Checkpoint format]
~~~~~~~~~~~~~~~~~~~~~~~~
A checkpoint is a directory <save_dir>/<tag>/ with
  states.bin   every chunk slot's bytes, one after another (16-bit params,
               fp32 master, momentum, variance; frozen params: 16-bit only);
               saved by N data-parallel ranks: states-rank<r>.bin, one per
               rank, each with the slots of the chunks that rank owns
               (Note [Data parallel by chunk] in tidal/data_parallel.py)
  meta.json    format version, the model's fingerprint (names, shapes,
               trainable), per slot: name, kind, dtype, file, offset, bytes,
               CRC-32; the engine's counters, the loss scaler and LR
               scheduler state
  extra.pt     small torch-saved objects: buffers, RNG states (each rank's),
               client_state
and <save_dir>/latest holds the newest tag (DeepSpeed's layout and names).
Slots are found by parameter name, not by rank: M ranks (or one process, or
a plain model through state_dict) load what N ranks saved, each rank reading
the 16-bit slots and the optimizer states of the chunks it owns now.

Saving never gathers the model anywhere: each slot is accessed on the host
(a device-resident chunk is copied down, as eviction would), written, and
released, so the extra memory is one chunk. Loading writes each slot in
place the same way.

Atomicity: everything is written into a temporary sibling directory, flushed
with fsync, and then renamed into place (with N ranks: by rank 0, once every
rank has written and flushed its file, so the set is atomic, not each file).
Replacing an existing tag renames it aside first, then renames the new one
in, then deletes the old one; a kill between the two renames leaves the old
copy under its aside name, which load_checkpoint finds. `latest` is replaced by rename too. So a save killed
at any moment leaves the previous checkpoint loadable.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import shutil
import uuid
import warnings
import zlib

import torch

from . import param_groups as _param_groups
from .store import (HOST, KIND_BY_NAME, KIND_NAMES, PARAM16, PARAM32, SLOT_KINDS, slot_kinds,
                    uncounted)

FORMAT = "tidal-checkpoint-2"
_READABLE = ("tidal-checkpoint-1", FORMAT)  # 1: one states.bin, no "file" per slot
_STATES, _META, _EXTRA, _LATEST = "states.bin", "meta.json", "extra.pt", "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this engine; the message says why."""


def _bytes_of(view: torch.Tensor) -> memoryview:
    return memoryview(view.view(torch.uint8).numpy())


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _commit(root: pathlib.Path, tmp: pathlib.Path, target: pathlib.Path, tag) -> None:
    """Renames the finished temporary directory in as `target` (Note [Checkpoint format])."""
    aside = None
    if target.exists():
        aside = root / f".{tag}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, aside)
    os.replace(tmp, target)
    _fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    # Leftovers of saves of this tag that were killed midway.
    for stale in list(root.glob(f".{tag}.tmp-*")) + list(root.glob(f".{tag}.old-*")):
        shutil.rmtree(stale, ignore_errors=True)


def _find(load_dir, tag) -> "pathlib.Path | None":
    """The checkpoint's directory; None (with a warning, as DeepSpeed) when there is none."""
    root = pathlib.Path(load_dir)
    if tag is None:
        latest = root / _LATEST
        if not latest.is_file():
            warnings.warn(f"tidal: load_checkpoint: no tag given and no '{_LATEST}' file in {root}; "
                          f"nothing loaded", stacklevel=4)
            return None
        tag = latest.read_text().strip()
    path = root / str(tag)
    if not (path / _META).is_file():
        # A save killed between its two renames left the old copy aside.
        aside = sorted(root.glob(f".{tag}.old-*"), key=lambda p: p.stat().st_mtime)
        if aside and (aside[-1] / _META).is_file():
            return aside[-1]
        if not path.exists():
            warnings.warn(f"tidal: load_checkpoint: no checkpoint {path}; nothing loaded",
                          stacklevel=4)
            return None
        raise CheckpointError(f"load_checkpoint: {path} is not a tidal checkpoint (no {_META})")
    return path


# Note [The RNG on load_checkpoint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# save_checkpoint keeps each rank's global torch RNG state (CPU and CUDA).
# tidal.initialize's engine restores it on load, so a resumed run draws the
# dropout masks and shuffles the uninterrupted run would have drawn.
# DeepSpeed's load_checkpoint does not touch the process's RNG (0.19.8,
# runtime/engine.py: no RNG state in its checkpoints): a DeepSpeed script
# seeds at its start and its resumed run goes on from there (HelloDeepSpeed
# seeds, builds the model, loads, then shuffles and drops out). So the engine
# tidal.deepspeed.initialize returns sets engine.restore_rng_on_load = False
# and its load_checkpoint leaves the RNG as it was; the state is saved either
# way. The switch is the engine's Checkpoints' (Checkpoints.restore_rng_on_load,
# read and set as engine.restore_rng_on_load): another engine in the process
# keeps its own.


def write_param(store, record, src: torch.Tensor) -> None:
    """`src` into `record`'s slots: the fp32 master (where this rank owns it)
    and the 16-bit copy (StateDictBridge writes a loaded value this way)."""
    flat = src.detach().reshape(-1).cpu()
    with torch.no_grad(), uncounted():
        kinds = (PARAM32, PARAM16) if record.trainable and store.owns(record) else (PARAM16,)
        for kind in kinds:
            with store.slots(record, (kind,), HOST) as (view,):
                view.copy_(flat)


class Checkpoints:
    """engine.save_checkpoint / load_checkpoint, state_dict / load_state_dict,
    load_pretrained / save_pretrained: the engine's states streamed chunk slot
    by slot (Note [Checkpoint format]). Made by the engine once its step
    exists, one per engine.

    State it owns: `restore_rng_on_load`, whether load_checkpoint sets the
    process's RNG to the saved one (Note [The RNG on load_checkpoint];
    tidal.deepspeed.initialize turns it off through engine.restore_rng_on_load).

    It holds no reference to the engine; what it reads and writes is passed in.

    Args:
        module: the engine's model (its buffers and state_dict keys).
        store: the ParamStore holding the chunks (slots, owners, data parallel).
        params: the engine's ParamTable (the records, in chunk order).
        hooks: the engine's ModuleHooks (whether gradients wait for a step).
        step: the engine's OptimizerStep (its counters, loss scaler, LR and
            LR schedulers, saved and restored).
        accumulation: the engine's GradientAccumulation (its micro-step count).
        optimizer: the engine's EngineOptimizer (its param_groups).
        config: the engine's Config.
    """

    def __init__(self, *, module: torch.nn.Module, store, params, hooks, step, accumulation,
                 optimizer, config):
        self._module = module
        self._store = store
        self._params = params
        self._hooks = hooks
        self._step = step
        self._accumulation = accumulation
        self._optimizer = optimizer
        self._config = config
        self.restore_rng_on_load = True  # Note [The RNG on load_checkpoint]

    def _group_state(self) -> list:
        """The parameter groups as a checkpoint keeps them (Note [Parameter groups])."""
        return _param_groups.state(self._optimizer.param_groups,
                                   lambda p: self._store.by_param[id(p)].name)

    def _fingerprint(self) -> list:
        # Sorted: the chunk order (first-use relayout) is not part of the model.
        return sorted([r.name, list(r.shape), bool(r.trainable)] for r in self._params.records)

    def _no_pending_gradients(self, who: str) -> None:
        if self._hooks.landed_params() or self._hooks.summed_params():
            raise RuntimeError(
                f"{who}: gradients of an unfinished step are pending (backward ran, step() did not); "
                f"call it between optimizer steps, or engine.zero_grad() first")

    def _write_states(self, path: pathlib.Path) -> tuple[list, dict, int]:
        """Writes the slots this rank holds of the chunks it owns (all of them on
        one process) to `path`: (slot entries, Adam steps by name, bytes)."""
        entries, steps = [], {}
        store = self._store
        offset = 0
        with open(path, "wb") as f, torch.no_grad(), uncounted():
            for r in self._params.records:
                if not store.owns(r):
                    continue
                steps[r.name] = r.step
                for kind in slot_kinds(r):
                    with store.slots(r, (kind,), HOST) as (view,):
                        data = _bytes_of(view)
                        f.write(data)
                        entries.append({"name": r.name, "kind": KIND_NAMES[kind], "dtype": str(view.dtype),
                                        "file": path.name, "offset": offset, "bytes": data.nbytes,
                                        "crc32": zlib.crc32(data)})
                        offset += data.nbytes
            f.flush()
            os.fsync(f.fileno())
        return entries, steps, offset

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True) -> pathlib.Path:
        self._no_pending_gradients("save_checkpoint")
        tag = str(tag) if tag is not None else f"global_step{self._step.global_steps}"
        if not tag or "/" in tag or tag.startswith("."):
            raise ValueError(f"save_checkpoint: tag {tag!r} must be a plain, non-hidden directory name")
        dp = self._store.dp
        if dp is not None:
            return self._save_ranks(dp, pathlib.Path(save_dir), tag, client_state, save_latest)
        root = pathlib.Path(save_dir)
        root.mkdir(parents=True, exist_ok=True)
        target = root / tag
        tmp = root / f".{tag}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            entries, steps, offset = self._write_states(tmp / _STATES)
            self._write_meta(tmp, tag, entries, steps, {_STATES: offset}, [_rng_state()], client_state)
            _commit(root, tmp, target, tag)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if save_latest:
            _write_atomic(root / _LATEST, tag.encode())
        return target

    def _save_ranks(self, dp, root: pathlib.Path, tag, client_state, save_latest) -> pathlib.Path:
        """save_checkpoint with N ranks: each writes its file into one temporary
        directory; rank 0 writes the manifest and renames the whole set in."""
        target = root / tag
        name = dp.broadcast_object(f".{tag}.tmp-{uuid.uuid4().hex[:8]}" if dp.rank == 0 else None, 0,
                                   "agree on the checkpoint's temporary directory")
        tmp = root / name
        error = None
        result = None
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir(exist_ok=True)
            result = self._write_states(tmp / f"states-rank{dp.rank:05d}.bin")
        except Exception as e:  # noqa: BLE001 -- every rank hears of it below
            error = f"rank {dp.rank}: {type(e).__name__}: {e}"
        parts = dp.all_gather_object((error, result, _rng_state()), "gather the checkpoint's parts")
        errors = [p[0] for p in parts if p[0] is not None]
        if not errors and dp.rank == 0:
            try:
                entries, steps, files = [], {}, {}
                for r, (_, (e, st, size), _) in enumerate(parts):
                    entries += e
                    steps.update(st)
                    files[f"states-rank{r:05d}.bin"] = size
                self._write_meta(tmp, tag, entries, steps, files, [p[2] for p in parts], client_state)
                _commit(root, tmp, target, tag)
                if save_latest:
                    _write_atomic(root / _LATEST, tag.encode())
            except Exception as e:  # noqa: BLE001 -- said to every rank below
                errors.append(f"rank 0: {type(e).__name__}: {e}")
        if dp.rank == 0 and errors:
            shutil.rmtree(tmp, ignore_errors=True)
        errors = dp.broadcast_object(errors, 0, "finish the checkpoint")
        if errors:
            raise RuntimeError(f"save_checkpoint: saving {target} failed, and the previous checkpoint "
                               f"stays: " + "; ".join(errors))
        return target

    def _write_meta(self, tmp: pathlib.Path, tag, entries, steps, files: dict, rngs: list,
                    client_state) -> None:
        meta = {
            "format": FORMAT,
            "tag": tag,
            "precision": self._store.precision,
            "optimizer_state_dtype": self._config.optimizer_state_dtype,
            "model": self._fingerprint(),
            "files": files,
            "world_size": len(rngs),
            "slots": entries,
            "steps": steps,
            "engine": {"global_steps": self._step.global_steps, "micro_steps": self._accumulation.micro_steps,
                       "skipped_steps": self._step.skipped_steps, "lr": self._step.lr,
                       "global_samples": self._step.global_samples},
            "param_groups": self._group_state(),
            "loss_scaler": self._step.scaler.state_dict(),
            "loss_scaler_type": type(self._step.scaler).__name__,
            "lr_scheduler": self._step.lr_scheduler.state_dict() if self._step.lr_scheduler else None,
        }
        buf = io.BytesIO()
        torch.save({"buffers": {k: v.detach().cpu() for k, v in self._module.named_buffers()},
                    "rng": rngs[0], "rng_ranks": rngs, "client_state": client_state,
                    # (a torch scheduler's state need not be JSON: here, not in the meta)
                    "client_lr_scheduler": None if self._step.client_lr_scheduler is None else
                    self._step.client_lr_scheduler.state_dict()}, buf)
        _write_atomic(tmp / _EXTRA, buf.getvalue())
        _write_atomic(tmp / _META, json.dumps(meta, indent=1).encode())
        _fsync_dir(tmp)

    def _check_groups(self, saved, path) -> None:
        """The checkpoint's parameter groups hold the same parameters as the
        engine's (Note [Parameter groups]); checked before anything is loaded."""
        if saved is None:
            return  # (a checkpoint from before parameter groups: one group)
        mine = self._group_state()
        theirs = [sorted(g["params"]) for g in saved]
        ours = [sorted(g["params"]) for g in mine]
        if theirs != ours:
            raise CheckpointError(
                f"load_checkpoint: {path} was saved with {len(theirs)} parameter group(s) of "
                f"{[len(t) for t in theirs]} parameters, the engine has {len(ours)} of "
                f"{[len(o) for o in ours]}; pass the same model_parameters to tidal.initialize, or "
                f"load_optimizer_states=False")

    def _load_groups(self, saved, path) -> None:
        if saved is None:
            return
        for group, g in zip(self._optimizer.param_groups, saved, strict=True):
            for key in ("lr", "initial_lr", "weight_decay", "eps"):
                group[key] = float(g[key])
            group["betas"] = tuple(float(b) for b in g["betas"])

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True,
                        load_lr_scheduler_states=True):
        """Returns (path, client_state); (None, None) when there is no checkpoint."""
        self._no_pending_gradients("load_checkpoint")
        path = _find(load_dir, tag)
        if path is None:
            return None, None
        try:
            meta = json.loads((path / _META).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"load_checkpoint: {path / _META} is unreadable or corrupt: {e}") from None
        if meta.get("format") not in _READABLE:
            raise CheckpointError(f"load_checkpoint: {path} has format {meta.get('format')!r}; "
                                  f"expected one of {', '.join(map(repr, _READABLE))}")
        mine = self._fingerprint()
        if meta["model"] != mine:
            theirs = {n: (s, t) for n, s, t in meta["model"]}
            ours = {n: (s, t) for n, s, t in mine}
            why = [f"'{n}' missing from the checkpoint" for n in ours if n not in theirs]
            why += [f"'{n}' in the checkpoint but not in the model" for n in theirs if n not in ours]
            why += [f"'{n}': shape/trainable {theirs[n]} in the checkpoint, {ours[n]} in the model"
                    for n in ours if n in theirs and theirs[n] != ours[n]]
            raise CheckpointError(f"load_checkpoint: {path} holds a different model: "
                                  + "; ".join(why[:5] or ["parameter order differs"])
                                  + (f" (and {len(why) - 5} more)" if len(why) > 5 else ""))
        theirs = meta.get("loss_scaler_type")
        if load_optimizer_states and theirs != type(self._step.scaler).__name__:
            raise CheckpointError(f"load_checkpoint: {path} has a {theirs} loss scaler, the engine a "
                                  f"{type(self._step.scaler).__name__} (fp16.loss_scale 0 = dynamic); use "
                                  f"the same fp16 settings, or load_optimizer_states=False")
        theirs = meta.get("optimizer_state_dtype", "fp32")
        if load_optimizer_states and theirs != self._config.optimizer_state_dtype:
            raise CheckpointError(f"load_checkpoint: {path} holds {theirs} Adam moments, the engine "
                                  f"keeps {self._config.optimizer_state_dtype} "
                                  f"(tidal.optimizer_state_dtype); use the same setting, or "
                                  f"load_optimizer_states=False to start the moments afresh")
        if meta["precision"] != self._store.precision:
            raise CheckpointError(f"load_checkpoint: {path} was saved in {meta['precision']}, the engine "
                                  f"runs {self._store.precision}")
        files = meta.get("files", {_STATES: meta.get("states_bytes")})
        for name, expected in files.items():
            size = (path / name).stat().st_size if (path / name).exists() else -1
            if size != expected:
                raise CheckpointError(f"load_checkpoint: {path / name} has {size} bytes, expected "
                                      f"{expected} (truncated or corrupt)")
        try:
            extra = torch.load(path / _EXTRA, weights_only=False)
        except Exception as e:  # noqa: BLE001 -- any unpickling failure is a corrupt file
            raise CheckpointError(f"load_checkpoint: {path / _EXTRA} is unreadable or corrupt: {e}") from None

        if load_optimizer_states:
            self._check_groups(meta.get("param_groups"), path)
        by_name = {r.name: r for r in self._params.records}
        wanted = set(SLOT_KINDS) if load_optimizer_states else {PARAM16, PARAM32}
        store = self._store
        with contextlib.ExitStack() as stack, torch.no_grad(), uncounted():
            opened = {}
            for e in meta["slots"]:
                states = path / e.get("file", _STATES)
                kind = KIND_BY_NAME.get(e["kind"])
                if kind is None:
                    raise CheckpointError(
                        f"load_checkpoint: slot {e['name']}/{e['kind']} in {states} names no chunk list "
                        f"this version knows (expected one of {', '.join(KIND_NAMES.values())})")
                if kind not in wanted:
                    continue
                r = by_name[e["name"]]
                if kind not in store.kinds_of(r):
                    continue  # data parallel: another rank owns this chunk's states
                if states.name not in files:
                    raise CheckpointError(f"load_checkpoint: slot {e['name']}/{e['kind']} names file "
                                          f"{states.name}, which {path / _META} does not list")
                f = opened.get(states.name)
                if f is None:
                    f = opened[states.name] = stack.enter_context(open(states, "rb"))
                # Read and check first, so a corrupt slot is never written.
                f.seek(e["offset"])
                data = f.read(e["bytes"])
                if len(data) != e["bytes"] or zlib.crc32(data) != e["crc32"]:
                    raise CheckpointError(
                        f"load_checkpoint: slot {e['name']}/{e['kind']} in {states} fails its CRC-32 "
                        f"check (corrupt file); slots before it were loaded already: load another "
                        f"checkpoint")
                with store.slots(r, (kind,), HOST) as (view,):
                    dst = _bytes_of(view)
                    if dst.nbytes != e["bytes"]:
                        raise CheckpointError(f"load_checkpoint: slot {e['name']}/{e['kind']} has "
                                              f"{e['bytes']} bytes in {path}, {dst.nbytes} in the model")
                    dst[:] = data
        if load_optimizer_states:
            for name, step in meta["steps"].items():
                by_name[name].step = int(step)
            self._step.scaler.load_state_dict(meta["loss_scaler"])
            self._load_groups(meta.get("param_groups"), path)
        eng = meta["engine"]
        self._step.global_steps = int(eng["global_steps"])
        self._accumulation.load_count(int(eng["micro_steps"]))
        self._step.skipped_steps = int(eng["skipped_steps"])
        # (checkpoints written before it was saved: DeepSpeed's count for the steps)
        self._step.global_samples = int(eng.get(
            "global_samples", self._step.global_steps * (self._config.train_batch_size or 0)))
        self._step.lr = float(eng["lr"])
        if load_lr_scheduler_states and self._step.lr_scheduler is not None and meta["lr_scheduler"]:
            self._step.lr_scheduler.load_state_dict(meta["lr_scheduler"])
            self._step.apply_lr_schedule()
        client = extra.get("client_lr_scheduler")
        if load_lr_scheduler_states and self._step.client_lr_scheduler is not None and client is not None:
            self._step.client_lr_scheduler.load_state_dict(client)
        buffers = dict(self._module.named_buffers())
        with torch.no_grad():
            for k, v in extra["buffers"].items():
                if k in buffers:
                    buffers[k].copy_(v)
        if self.restore_rng_on_load:  # Note [The RNG on load_checkpoint]
            rng = extra["rng"]
            rank = store.dp.rank if store.dp is not None else 0
            if rank < len(extra.get("rng_ranks", [])):
                rng = extra["rng_ranks"][rank]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        return path, extra["client_state"]

    # ------------------------------------------------------------ state dicts
    def state_dict(self) -> dict:
        """An ordinary state_dict of fp32 tensors keyed like self._module's own."""
        out = {}
        # (Data parallel: every rank calls it; masters come from their owners.)
        for key, value in self._module.state_dict(keep_vars=True).items():
            record = self._store.by_param.get(id(value))
            if record is not None and record.param is value:
                out[key] = self._store.gather(record).float()
            else:
                t = value.detach()
                out[key] = (t.float() if t.is_floating_point() else t).cpu().clone()
        return out

    def load_state_dict(self, state, strict=True):
        """Loads fp32 (or any float) weights into the chunks: fp32 master and 16-bit copy.

        Tied parameters need only one of their keys (Hugging Face checkpoints omit
        the tied lm_head). Returns torch's (missing_keys, unexpected_keys).
        """
        return self._load_tensors(list(state), state.__getitem__, lambda k: list(state[k].shape),
                                  strict, "load_state_dict")

    def _load_tensors(self, keys, get, shape_of, strict, who):
        """Loads tensor `get(key)` for each key, one at a time (streaming)."""
        self._no_pending_gradients(who)
        own = self._module.state_dict(keep_vars=True)
        given = set(keys)
        unexpected = [k for k in keys if k not in own]
        covered, shape_errors = set(), []

        def ident(key, value):
            record = self._store.by_param.get(id(value))
            if record is not None and record.param is value:
                return record
            return None

        # Check every shape before writing anything: a mismatch loses nothing.
        plan = []
        for key, value in own.items():
            if key not in given:
                continue
            record = ident(key, value)
            plan.append((key, value, record))
        for key, value, record in plan:
            given_shape = list(shape_of(key))
            shape = list(record.shape) if record is not None else list(value.shape)
            if given_shape != shape:
                shape_errors.append(f"'{key}': {given_shape} given, {shape} in the model")
        missing = []
        for key, value in own.items():
            record = ident(key, value)
            if key in given:
                covered.add(id(record) if record is not None else key)
        for key, value in own.items():
            record = ident(key, value)
            if (id(record) if record is not None else key) not in covered:
                missing.append(key)
        problems = list(shape_errors)
        if strict:
            if missing:
                problems.append(f"missing keys: {', '.join(missing[:8])}"
                                + (" ..." if len(missing) > 8 else ""))
            if unexpected:
                problems.append(f"unexpected keys: {', '.join(unexpected[:8])}"
                                + (" ..." if len(unexpected) > 8 else ""))
        if problems:
            raise CheckpointError(f"{who}: " + "; ".join(problems) + " (nothing was loaded)")
        for key, value, record in plan:
            src = get(key)
            if record is not None:
                write_param(self._store, record, src)
            else:
                with torch.no_grad():
                    value.copy_(src)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def load_pretrained(self, path, strict=True):
        """Loads Hugging Face `save_pretrained` weights (model.safetensors, sharded
        safetensors with an index, or pytorch_model.bin) into the chunks, one
        tensor at a time where the format allows."""
        path = pathlib.Path(path)
        files = []
        if path.is_file():
            files = [path]
        else:
            for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
                if (path / index).is_file():
                    shards = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
                    files = [path / s for s in shards]
                    break
            else:
                for name in ("model.safetensors", "pytorch_model.bin"):
                    if (path / name).is_file():
                        files = [path / name]
                        break
        if not files:
            raise CheckpointError(f"load_pretrained: no model.safetensors or pytorch_model.bin (or their "
                                  f"index) in {path}")
        if all(f.suffix == ".safetensors" for f in files):
            from safetensors import safe_open
            with contextlib.ExitStack() as stack:
                handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
                where = {k: h for h in handles for k in h.keys()}
                return self._load_tensors(list(where), lambda k: where[k].get_tensor(k),
                                          lambda k: where[k].get_slice(k).get_shape(), strict,
                                          "load_pretrained")
        state = {}
        for f in files:
            state.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        return self._load_tensors(list(state), state.__getitem__, lambda k: list(state[k].shape),
                                  strict, "load_pretrained")

    def save_pretrained(self, save_dir, max_shard_size="5GB", dtype=None):
        """Writes the weights as Hugging Face's `save_pretrained` does: safetensors
        (sharded with model.safetensors.index.json past `max_shard_size`), and the
        model's config.json when it has a Hugging Face config. One shard is
        gathered from the chunks at a time, so host memory holds at most one
        shard beyond the chunks. Tied weights are written once, under their first
        key (the embedding), as Hugging Face does. `dtype` (a torch dtype): the
        saved tensors' dtype; None keeps fp32 masters as fp32. Returns the files
        written.
        """
        from safetensors.torch import save_file

        from .._C import parse_bytes

        self._no_pending_gradients("save_pretrained")
        limit = parse_bytes(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
        if limit <= 0:
            raise ValueError(f"save_pretrained: max_shard_size must be positive, got {max_shard_size!r}")
        save_dir = pathlib.Path(save_dir)
        # Data parallel: every rank gathers (the masters come from their owners),
        # rank 0 writes.
        writer = self._store.dp is None or self._store.dp.rank == 0
        if writer:
            save_dir.mkdir(parents=True, exist_ok=True)
        # Plan: (key, record or tensor, bytes) in state_dict order, tied keys once.
        plan, seen = [], set()
        for key, value in self._module.state_dict(keep_vars=True).items():
            record = self._store.by_param.get(id(value))
            if record is not None and record.param is value:
                if id(record) in seen:
                    continue
                seen.add(id(record))
                numel, item = record.numel, record
            else:
                numel, item = value.numel(), value
            size = torch.empty((), dtype=dtype or torch.float32).element_size()
            plan.append((key, item, numel * size))
        shards, current, current_bytes = [], [], 0
        for entry in plan:
            if current and current_bytes + entry[2] > limit:
                shards.append(current)
                current, current_bytes = [], 0
            current.append(entry)
            current_bytes += entry[2]
        if current or not shards:
            shards.append(current)
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        written, weight_map, total = [], {}, 0
        with torch.no_grad(), uncounted():
            for name, shard in zip(names, shards):
                tensors = {}
                for key, item, nbytes in shard:
                    t = self._store.gather(item) if not isinstance(item, torch.Tensor) else \
                        item.detach().cpu()
                    if t.is_floating_point():
                        t = t.to(dtype or torch.float32)
                    tensors[key] = t.contiguous()
                    weight_map[key] = name
                    total += nbytes
                written.append(save_dir / name)
                if not writer:
                    continue
                tmp = save_dir / f".{name}.{uuid.uuid4().hex}.tmp"
                save_file(tensors, str(tmp), metadata={"format": "pt"})
                os.replace(tmp, save_dir / name)
        if not writer:
            return written
        if len(shards) > 1:
            index = save_dir / "model.safetensors.index.json"
            index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                        indent=2, sort_keys=True))
            written.append(index)
        config = getattr(self._module, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(save_dir)
            written.append(save_dir / "config.json")
        return written
