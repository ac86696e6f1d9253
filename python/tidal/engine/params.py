"""The model's parameters as the engine knows them: which module owns which
records, and the records' stable indexes.

ParamTable is built once, by tidal.initialize's registration (register()),
and read by every part of the engine; only the relayout after the warm-up
step changes it (reorder()). A record is a parameter's entry in the
ParamStore (store.py: its slots in chunks); its index here is its position
in registration order, which the C++ hooks (ModuleHooks) use to name it and
which never changes, while the record's id in the chunk store changes at a
relayout.
"""
from __future__ import annotations

import torch

from . import external as _external
from .errors import UnsupportedModelError


class ParamTable:
    """Modules and records of one engine.

    module_records: module -> its records, in registration (module) order;
        the root is always there, hooked even without parameters of its own,
        so that a parameter read in any forward has a module to serve it for
        (Note [External parameters] in hooks/module_hooks.h).
    names:          module -> its qualified name (the first module owning a
        parameter names it).
    module_list / module_index: the modules' stable indexes (the tracer's
        timeline and ModuleHooks name modules by them).
    record_list / record_index: the records' stable indexes (id(record) ->
        index); record_set the same records as a set.
    records:        the records in chunk order (registration order until the
        relayout, first-use order after it).
    """

    def __init__(self, module_records: dict, names: dict, store_records: list):
        self.module_records = module_records
        self.names = names
        self.module_list = list(module_records)
        self.module_index = {m: i for i, m in enumerate(self.module_list)}
        mine = {id(r) for recs in module_records.values() for r in recs}
        self.records = [r for r in store_records if id(r) in mine]
        self.record_list = list(self.records)
        self.record_set = set(self.records)
        self.record_index = {id(r): i for i, r in enumerate(self.record_list)}

    @classmethod
    def register(cls, model: torch.nn.Module, store) -> "ParamTable":
        """Puts `model`'s parameters into `store`'s chunks, module by module
        (the first use order of most models), and returns the table. On any
        error the parameters registered here go back to the model."""
        module_records: dict[torch.nn.Module, list] = {}
        names: dict[torch.nn.Module, str] = {}
        added = []  # (record, the parameter's dtype) registered here
        # The model's elements (trainable, frozen), for the error that gives
        # the bytes the whole run needs.
        unique = {id(p): p for p in model.parameters()}.values()
        model_params = (sum(p.numel() for p in unique if p.requires_grad),
                        sum(p.numel() for p in unique if not p.requires_grad))
        try:
            for mname, m, owned in _external.owned_parameters(model):
                names[m] = mname or type(m).__name__
                if getattr(m, "sparse", False) is True and any(
                        p.requires_grad for p in m.parameters(recurse=False)):
                    raise UnsupportedModelError(
                        f"module '{names[m]}' ({type(m).__name__}) has sparse=True: its "
                        f"gradients are sparse tensors, and tidal's chunks hold dense gradients "
                        f"in the parameters' 16-bit slots; build it with sparse=False (or "
                        f"freeze its parameters)")
                if owned is None:
                    continue  # inside a leaf module (tidal.set_leaf_modules): no hooks of its own
                recs = []
                for full, p in owned:
                    rec = store.by_param.get(id(p))
                    if rec is None:
                        if p.numel() == 0:
                            continue  # nothing to keep; stays an ordinary tensor
                        dtype = p.dtype
                        rec = store.add(p, full, module=m, model_params=model_params)
                        added.append((rec, dtype))
                    elif rec.provisional:
                        rec.name, rec.provisional = full, False
                    recs.append(rec)
                if recs:
                    module_records[m] = recs
            # Parameters registered by hand (tidal.register_external_parameter).
            known = {id(r) for recs in module_records.values() for r in recs}
            for m in model.modules():
                for p in _external.marked_external(m):
                    rec = store.by_param.get(id(p))
                    if rec is None or id(rec) not in known:
                        raise ValueError(
                            f"tidal.register_external_parameter: a parameter registered for module "
                            f"'{names.get(m, type(m).__name__)}' is not a parameter of the "
                            f"model passed to tidal.initialize")
                    recs = module_records.setdefault(m, [])
                    if all(rec is not r for r in recs):
                        recs.append(rec)
            module_records.setdefault(model, [])
            # Every chunk of the NVMe tier's lists gets its home in the file
            # now: a disk too small fails here, not in a step.
            store.chunks.reserve_disk()
        except BaseException:
            store.give_back(added)  # the model keeps its values
            raise
        table = cls(module_records, names, store.records)
        # Records of an init_context store that this model does not own.
        store.discard([r for r in store.records if r not in table.record_set])
        return table

    def index(self, record) -> int:
        return self.record_index[id(record)]

    def indexes(self, records) -> list[int]:
        """The stable indexes of `records`, in their order."""
        index = self.record_index
        return [index[id(r)] for r in records]

    def in_record_order(self, indexes) -> list:
        """The records of `indexes` (any order), in chunk order."""
        wanted = set(indexes)
        if not wanted:
            return []
        index = self.record_index
        return [r for r in self.records if index[id(r)] in wanted]

    def reorder(self, store_records) -> None:
        """After a relayout: the records in the store's new chunk order."""
        self.records = [r for r in store_records if r in self.record_set]

    def name(self, module) -> str:
        return self.names.get(module, type(module).__name__)
