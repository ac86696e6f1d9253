"""The engine's objects built through their own constructors, without an
Engine (Note [The engine's objects, in the order they are built] in
python/tidal/engine/engine.py): each is given only what it reads, so each
can be made and checked on its own. References are independent of tidal:
the model's own named_parameters and state_dict, and counts written out by
hand."""
import copy
import gc
import weakref

import pytest
import torch

import tidal
from tidal.config import Config
from tidal.engine import budget as _budget
from tidal.engine.accumulation import GradientAccumulation
from tidal.engine.checkpoint import CheckpointError, Checkpoints
from tidal.engine.dtr_link import DtrLink
from tidal.engine.errors import UnsupportedModelError
from tidal.engine.hook_wiring import HookWiring, new_tracer
from tidal.engine.meters import StepMeters
from tidal.engine.params import ParamTable
from tidal.engine.store import PARAM16, PARAM32, ParamStore


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def _config(**tidal_keys):
    t = {"chunk_size": 4096, "device_memory_budget": "64MiB", "device_margin": 1024}
    t.update(tidal_keys)
    return Config.load({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "tidal": t})


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.last = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.last(self.norm(self.first(x)))


class _DtrOff:
    """What HookWiring reads of a DtrLink at construction (DTR not asked for
    by the config); test_dtr_link_... builds a DtrLink itself."""
    enabled_by_config = False


def _parts(model, cfg):
    """A store, the ParamTable registering `model` into it, and the HookWiring
    over them: each from its own constructor, in the engine's order."""
    store = ParamStore(cfg)
    store.adopted()
    params = ParamTable.register(model, store)
    room = _budget.check(params, store, cfg)
    tracer = new_tracer(store, False, False, room.warmup_chunk_room)
    wiring = HookWiring(store=store, params=params, config=cfg, tracer=tracer, dtr=_DtrOff(),
                        overlap=None, dtype=store.dtype, cuda=False, cuda_room=False,
                        sim_caching=False, enforce_budget=False, budget=lambda: room)
    return store, params, wiring


def test_param_table_registers_a_model_in_module_order():
    torch.manual_seed(0)
    model = _Net()
    names = [n for n, _ in model.named_parameters()]
    store, params, _ = _parts(model, _config())
    # Records in module order, named as the model names its parameters.
    assert [r.name for r in params.records] == names
    assert [r.name for r in params.record_list] == names
    assert params.module_list[:3] == [model.first, model.norm, model.last]
    assert [r.name for r in params.module_records[model.first]] == ["first.weight", "first.bias"]
    assert [r.name for r in params.module_records[model.last]] == ["last.weight"]
    assert params.module_records[model] == []  # the root is hooked without parameters of its own
    assert params.name(model.norm) == "norm"
    # Stable indexes: the records' positions in registration order.
    assert params.indexes(params.records) == list(range(len(names)))
    assert [params.index(r) for r in params.records] == list(range(len(names)))
    assert params.in_record_order([4, 0, 2]) == [params.record_list[i] for i in (0, 2, 4)]
    assert params.in_record_order([]) == []
    # A relayout changes the chunk order, never the indexes.
    reordered = list(reversed(store.records))
    params.reorder(reordered)
    assert params.records == list(reversed(params.record_list))
    assert params.index(params.records[0]) == len(names) - 1


def test_param_table_refuses_a_sparse_module_and_gives_the_parameters_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Embedding(10, 4, sparse=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    store = ParamStore(_config())
    store.adopted()
    with pytest.raises(UnsupportedModelError, match="sparse=True"):
        ParamTable.register(model, store)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_step_meters_count_each_steps_bytes_and_keep_a_replaced_schedulers_counters():
    meters = StepMeters()
    base = {"bytes_host_to_device": 100, "bytes_device_to_host": 10, "evictions": 1,
            "peak_resident_bytes_device": 50, "resident_bytes_device": 40,
            "bytes_disk_to_host": 4, "bytes_host_to_disk": 2}
    meters.start(base)
    meters.end_step({**base, "bytes_host_to_device": 180, "bytes_device_to_host": 30})
    assert meters.bytes_per_step == [(80, 20)]
    # A relayout: the old scheduler's last counters stay in the reports; the
    # new one counts from its own start.
    final = {**base, "bytes_host_to_device": 200, "bytes_device_to_host": 35, "evictions": 3,
             "peak_resident_bytes_device": 90}
    fresh = {"bytes_host_to_device": 7, "bytes_device_to_host": 0, "evictions": 0,
             "peak_resident_bytes_device": 20, "resident_bytes_device": 20,
             "bytes_disk_to_host": 0, "bytes_host_to_disk": 0}
    meters.relayout(final, fresh)
    meters.end_step({**fresh, "bytes_host_to_device": 57, "bytes_device_to_host": 5})
    assert meters.bytes_per_step == [(80, 20), (50, 5)]
    now = {**fresh, "bytes_host_to_device": 57, "bytes_device_to_host": 5, "evictions": 2}
    merged = meters.scheduler_stats(now)
    assert merged == {"bytes_host_to_device": 257, "bytes_device_to_host": 40, "evictions": 5,
                      "peak_resident_bytes_device": 90,   # peaks: the larger
                      "resident_bytes_device": 20,        # what is resident: the live one's
                      "bytes_disk_to_host": 4, "bytes_host_to_disk": 2}
    assert type(StepMeters().scheduler_stats(now)) is dict


def test_gradient_accumulation_window_and_its_counts():
    torch.manual_seed(0)
    model = _Net()
    cfg = _config()
    store, params, wiring = _parts(model, cfg)
    with pytest.raises(ValueError, match="got 0"):
        GradientAccumulation(steps=0, params=params, hooks=wiring.hooks, store=store, config=cfg,
                             host_short=lambda: False)
    acc = GradientAccumulation(steps=3, params=params, hooks=wiring.hooks, store=store, config=cfg,
                               host_short=lambda: False)
    given_back = []
    acc.connect(give_weights_back=given_back.append)
    assert acc.summing and acc.micro_steps == 0
    ends, boundaries = [], []
    for _ in range(6):
        ends.append(acc.next_backward_ends_window())
        acc.backward_done()
        boundaries.append(acc.is_boundary())
    assert ends == boundaries == [False, False, True, False, False, True]
    assert acc.micro_steps == 6
    acc.forced_boundary = True  # set_gradient_accumulation_boundary(True): a short last window
    assert acc.is_boundary() and acc.next_backward_ends_window()
    acc.forced_boundary = None
    acc.load_count(4)
    assert acc.micro_steps == 4 and not acc.is_boundary()
    with pytest.raises(ValueError, match="got -1"):
        acc.load_count(-1)
    # Nothing has landed: nothing pending, nothing given back; a broken
    # window is mended by reset() (engine.zero_grad()).
    assert acc.pending() == [] and acc.landed() == [] and acc.summed() == []
    acc.break_window("a failed backward folded part of its gradients")
    assert acc.broken.startswith("a failed backward")
    acc.reset()
    assert acc.broken is None and given_back == []


def test_checkpoints_read_and_write_the_chunks_as_the_model_did():
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model.state_dict())
    cfg = _config()
    store, params, wiring = _parts(model, cfg)
    # The parameters now live in chunks; the module holds placeholders.
    assert model.first.weight.numel() == 0
    ck = Checkpoints(module=model, store=store, params=params, hooks=wiring.hooks, step=None,
                     accumulation=None, optimizer=None, config=cfg)
    assert ck.restore_rng_on_load
    got = ck.state_dict()
    assert list(got) == list(reference)
    for k, v in reference.items():
        assert torch.equal(got[k], v), k
    # Load new values: both the master and the 16-bit copy take them.
    new = {k: torch.randn_like(v) for k, v in reference.items()}
    result = ck.load_state_dict(new)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in ck.state_dict().items():
        assert torch.equal(v, new[k]), k
    w = params.module_records[model.first][0]
    assert torch.equal(store.gather(w, PARAM16).float().reshape(new["first.weight"].shape),
                       new["first.weight"])
    assert torch.equal(store.gather(w, PARAM32).reshape(new["first.weight"].shape), new["first.weight"])
    # A wrong shape loads nothing.
    bad = {**reference, "last.weight": torch.zeros(3, 3)}
    with pytest.raises(CheckpointError, match="'last.weight': \\[3, 3\\] given, \\[4, 16\\]"):
        ck.load_state_dict(bad)
    assert torch.equal(ck.state_dict()["first.bias"], new["first.bias"])


def test_the_engine_keeps_or_restores_the_rng_as_restore_rng_on_load_says(tmp_path):
    torch.manual_seed(0)
    engine = tidal.initialize(_Net(), {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                       "tidal": {"chunk_size": 4096, "device_memory_budget": "64MiB"}})
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()
    torch.manual_seed(123)
    saved_draw = torch.rand(3)  # what the RNG gives right after the save
    torch.manual_seed(123)
    engine.save_checkpoint(tmp_path, tag="t")
    torch.rand(5)
    assert engine.restore_rng_on_load is True
    engine.load_checkpoint(tmp_path, tag="t")
    assert torch.equal(torch.rand(3), saved_draw)  # restored: the draws of the saved run
    engine.restore_rng_on_load = False  # tidal.deepspeed.initialize's setting
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    engine.load_checkpoint(tmp_path, tag="t")
    assert torch.equal(torch.rand(3), expected)  # left as it was
    engine.remove_hooks()


def test_dtr_link_reads_the_store_at_start_and_goes_with_its_owner():
    cfg = _config(dtr={"enabled": True})
    store, _params, wiring = _parts(_Net(), cfg)
    link = DtrLink(cfg.dtr)
    assert link.enabled_by_config and link.cap == 0  # (no eviction_threshold in the block)
    link.start(hooks=wiring.hooks, wiring=wiring, store=store)
    # The arbiter prices a chunk's round trip with the simulated device's own link.
    assert link.link_bytes_per_s == float(store.device.info()["sim_copy_bandwidth"])
    report = link.report()
    assert report["managed_threshold"] is True and report["enabled"] is False  # (no forward began)
    assert report["replay_attaches"] == 0 and report["evictions"] == 0

    class Owner:
        pass

    owner = Owner()
    link.abandon_with(owner)
    ref = weakref.ref(link)
    del link
    gc.collect()
    assert ref() is not None  # registered with tidal.dtr while its owner lives
    del owner
    gc.collect()
    assert ref() is None  # its owner gone, tidal.dtr let it go
