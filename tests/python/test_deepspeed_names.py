"""The names DeepSpeed scripts import, under tidal.deepspeed: the accelerator,
comm, ops (adam runs; lamb, lion, adagrad refused), moe (refused), zero /
runtime.zero, utils, and the ZeRO-3 attributes on the parameters tidal trains.
Each answers as DeepSpeed 0.19.8's does for the device tidal trains on (here
the simulated device: DeepSpeed's CPU accelerator), checked against torch and
against what the device itself reports."""
import importlib
import logging
import sys
from pathlib import Path

import pytest
import torch

import tidal
import tidal.deepspeed as deepspeed
from tidal.engine.errors import UsageError

sys.path.insert(0, str(Path(__file__).parent))
from tidal.models.gpt import TanhChain  # noqa: E402

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
       "tidal": {"chunk_size": 4096, "device_margin": 1024}}


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def test_deepspeeds_import_lines_work_with_the_package_name_changed():
    # The forms DeepSpeedExamples use, with `deepspeed` -> `tidal.deepspeed`.
    import tidal.deepspeed.comm as dist
    from tidal.deepspeed import comm, get_accelerator
    from tidal.deepspeed.accelerator import get_accelerator as from_module
    from tidal.deepspeed.moe.layer import MoE
    from tidal.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from tidal.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from tidal.deepspeed.ops.lamb import FusedLamb
    from tidal.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from tidal.deepspeed.utils import set_z3_leaf_modules
    assert dist is comm is deepspeed.comm and get_accelerator is from_module
    assert deepspeed.zero is deepspeed.runtime.zero is importlib.import_module(
        "tidal.deepspeed.zero")
    assert deepspeed.zero.Init is importlib.import_module(
        "tidal.deepspeed.runtime.zero.partition_parameters").Init
    assert issubclass(DeepSpeedCPUAdam, torch.optim.Optimizer) and issubclass(FusedAdam,
                                                                              torch.optim.Adam)
    assert ZeroParamStatus.NOT_AVAILABLE.value == 2  # DeepSpeed's values
    assert all(callable(x) for x in (MoE, FusedLamb, set_z3_leaf_modules,
                                     split_params_into_different_moe_groups_for_optimizer))


# --- the accelerator ---------------------------------------------------------

def test_the_accelerator_of_the_simulated_device_is_deepspeeds_cpu_accelerator():
    acc = deepspeed.get_accelerator()
    assert acc.device_name() == acc.device_name(0) == acc.current_device_name() == "cpu"
    engine, *_ = deepspeed.initialize(model=TanhChain(16, 3), config=CFG)
    # Where the engine computes is where the script sends its batches.
    assert torch.device(acc.device_name(), engine.local_rank).type == engine.device.type
    assert acc.device_count() == 1 and acc.is_available() and acc.current_device() == 0
    assert acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    x = torch.ones(3)
    assert acc.on_accelerator(x) and acc.pin_memory(x) is x
    acc.set_device(0)
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed_all(7)
    got = torch.rand(4)
    assert torch.equal(got, torch.rand(4, generator=torch.Generator().manual_seed(7)))
    acc.manual_seed(8)
    assert torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(8)))
    assert acc.random() is torch.random
    with pytest.raises(AttributeError, match="get_accelerator\\(\\).range_push is not provided"):
        acc.range_push("x")


def test_the_simulated_accelerators_memory_is_the_devices():
    acc = deepspeed.get_accelerator()
    device = tidal.get_device()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    assert before == device.memory_stats()["in_use"]
    buf = device.allocate(1 << 20)
    assert acc.memory_allocated() == before + (1 << 20)
    assert acc.max_memory_allocated() >= before + (1 << 20)
    assert acc.total_memory() == 1 << 30
    assert acc.available_memory() == (1 << 30) - acc.memory_allocated()
    del buf
    assert acc.memory_allocated() == before
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == before


# --- comm ----------------------------------------------------------------------

def test_comm_in_one_process_without_a_launcher_is_a_world_of_one(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    dist = deepspeed.comm
    deepspeed.init_distributed()
    assert not torch.distributed.is_initialized() and not dist.is_initialized()
    assert dist.get_rank() == 0 and dist.get_world_size() == 1 and dist.get_local_rank() == 0
    assert dist.get_global_rank() == 0
    t = torch.tensor([1.5, -2.0])
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
        assert dist.all_reduce(t, op=op) is None and torch.equal(t, torch.tensor([1.5, -2.0]))
    dist.broadcast(t, src=0)
    dist.barrier()
    out = [torch.zeros(2)]
    dist.all_gather(out, t)
    assert torch.equal(out[0], t)
    whole = torch.zeros(2)
    dist.all_gather_into_tensor(whole, t)
    assert torch.equal(whole, t)
    objs = [None]
    dist.all_gather_object(objs, {"a": 1})
    assert objs == [{"a": 1}]
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert dist.get_local_rank() == 2
    with pytest.raises(UsageError, match="broadcast\\(src=1\\): one process without "
                                         "torch.distributed has only rank 0"):
        dist.broadcast(t, src=1)
    with pytest.raises(UsageError, match="all_reduce\\(async_op=True\\)"):
        dist.all_reduce(t, async_op=True)
    with pytest.raises(UsageError, match="get_rank\\(group=.*no groups"):
        dist.get_rank(group=object())
    with pytest.raises(UsageError, match="all_gather: tensor_list has 2 tensors"):
        dist.all_gather([torch.zeros(2), torch.zeros(2)], t)


def test_comm_under_a_one_rank_launcher_is_torch_distributeds(one_rank_launcher):
    dist = deepspeed.comm
    dist.init_distributed()
    assert torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
    assert dist.get_rank() == torch.distributed.get_rank() == 0
    assert dist.get_world_size() == torch.distributed.get_world_size() == 1
    assert dist.get_world_group() is torch.distributed.group.WORLD
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    work = dist.all_reduce(t, async_op=True)  # torch's: a handle to wait on
    work.wait()
    assert t.item() == 3.0
    dist.barrier()


def test_initialize_starts_torch_distributed_under_a_one_rank_launcher(one_rank_launcher):
    # DeepSpeed's initialize calls init_distributed first (dist_init_required None):
    # a script may ask torch.distributed for its rank right after.
    assert not torch.distributed.is_initialized()
    engine, *_ = deepspeed.initialize(model=TanhChain(16, 3), config=CFG)
    one_rank_launcher.append(engine)
    assert torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
    assert torch.distributed.get_rank() == engine.global_rank == 0
    assert torch.distributed.get_world_size() == engine.world_size == 1
    engine2, *_ = deepspeed.initialize(model=TanhChain(16, 3), config=CFG,
                                       dist_init_required=False)  # started: as asked
    one_rank_launcher.append(engine2)


# --- ops -----------------------------------------------------------------------

def _steps(opt, params, n=3, seed=5):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("make,ref", [
    (lambda p: deepspeed.ops.adam.DeepSpeedCPUAdam(p, lr=0.1, weight_decay=0.2),
     lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.2)),
    (lambda p: deepspeed.ops.adam.DeepSpeedCPUAdam(p, lr=0.1, weight_decay=0.2, adamw_mode=False),
     lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.2)),
    (lambda p: deepspeed.ops.adam.FusedAdam(p, lr=0.1, weight_decay=0.2),
     lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.2)),
    (lambda p: deepspeed.ops.adam.FusedAdam(p, lr=0.1, weight_decay=0.2, adam_w_mode=False),
     lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.2)),
])
def test_deepspeeds_adam_classes_step_alone_as_torchs(make, ref):
    torch.manual_seed(0)
    mine = [torch.nn.Parameter(torch.randn(n)) for n in (1, 7, 33)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    _steps(make(mine), mine)
    _steps(ref(theirs), theirs)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_deepspeeds_adam_classes_refuse_what_they_cannot_do_by_name():
    ops = deepspeed.ops
    bf16 = [torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))]
    opt = ops.adam.DeepSpeedCPUAdam(bf16)  # taken when built, as DeepSpeed's
    bf16[0].grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype torch.bfloat16, expected torch.float32"):
        opt.step()
    p = [torch.nn.Parameter(torch.ones(4))]
    with pytest.raises(UsageError, match="DeepSpeedCPUAdam\\(amsgrad=True\\): tidal's Adam has "
                                         "no AMSGrad variant"):
        ops.adam.DeepSpeedCPUAdam(p, amsgrad=True)
    with pytest.raises(UsageError, match="FusedAdam\\(amsgrad=True\\)"):
        ops.adam.FusedAdam(p, amsgrad=True)
    fused = ops.adam.FusedAdam(p, bias_correction=False)
    p[0].grad = torch.ones(4)
    with pytest.raises(UsageError, match="param_groups\\[0\\] has bias_correction=False"):
        fused.step()
    fused.zero_grad()
    assert p[0].grad is None  # set_grad_none, DeepSpeed's default
    for cls, message in ((ops.lamb.FusedLamb, "LAMB scales each layer's update"),
                         (ops.lion.FusedLion, "Lion's sign update"),
                         (ops.lion.DeepSpeedCPULion, "Lion's sign update"),
                         (ops.adagrad.DeepSpeedCPUAdagrad, "Adagrad's accumulated squares")):
        with pytest.raises(UsageError, match=f"{cls.__name__}: {message}"):
            cls(p, lr=1e-3)


# --- moe -----------------------------------------------------------------------

def test_moe_layers_are_refused_and_the_group_split_keeps_dense_groups():
    from tidal.deepspeed.moe.layer import MoE
    from tidal.deepspeed.moe.utils import (has_moe_layers,
                                           split_params_into_different_moe_groups_for_optimizer)
    with pytest.raises(UsageError, match="MoE: tidal has no mixture-of-experts layers"):
        MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2)
    net = TanhChain(8, 2)
    group = {"params": (p for p in net.parameters()), "name": "parameters"}
    split = split_params_into_different_moe_groups_for_optimizer(group)
    assert split == [group] and group["params"] == list(net.parameters())
    assert has_moe_layers(net) == (False, 0)
    net.layers[0].weight.allreduce = False  # what DeepSpeed's experts set
    net.layers[0].weight.group_name = "ep_size_2"
    with pytest.raises(UsageError, match="group 0 holds an expert parameter"):
        split_params_into_different_moe_groups_for_optimizer([{"params": list(net.parameters())}])
    with pytest.raises(UsageError, match="expected a parameter-group dict.*got str"):
        split_params_into_different_moe_groups_for_optimizer("params")


# --- utils ---------------------------------------------------------------------

def test_utils_set_z3_leaf_modules_and_log_dist(caplog):
    from tidal.engine.external import is_leaf
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    marked = deepspeed.utils.set_z3_leaf_modules(net, [torch.nn.Sequential])
    assert marked == [net, net[1]] and is_leaf(net[1]) and not is_leaf(net[0])
    assert deepspeed.utils.set_z3_leaf_modules(torch.nn.Linear(2, 2), [torch.nn.GRU],
                                               raise_if_not_found=False) == []
    with pytest.raises(ValueError, match="no module of"):
        deepspeed.utils.set_z3_leaf_modules(torch.nn.Linear(2, 2), [torch.nn.GRU])
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        deepspeed.utils.log_dist("to rank 0", ranks=[0])
        deepspeed.utils.log_dist("to rank 1", ranks=[1])
    assert [r.getMessage() for r in caplog.records] == ["[Rank 0] to rank 0"]


# --- DeepSpeed's ZeRO-3 attributes (Note [DeepSpeed's ZeRO-3 attributes on
# tidal's parameters]) -------------------------------------------------------------

def _deepspeed_chat_count(model):
    # DeepSpeed-Chat's and the SuperOffload fine-tune's count.
    return sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())


@pytest.mark.filterwarnings("ignore:config key")
def test_the_parameters_tidal_trains_carry_zero3s_attributes_as_deepspeed_sets_them():
    from tidal.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    torch.manual_seed(0)
    model = TanhChain(16, 3)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    count = sum(p.numel() for p in model.parameters())
    # (Under ZeRO stage 3, where DeepSpeed sets them: test_deepspeed_scripts_rest.py
    # checks that stages 0-2 do not.)
    engine, *_ = deepspeed.initialize(model=model, config=dict(CFG, zero_optimization={"stage": 3}))
    # (Placeholders answer their shapes: Note [A parameter object stays the user's].)
    assert sum(p.numel() for p in model.parameters()) == count
    assert _deepspeed_chat_count(model) == count == engine.num_parameters()
    ids = set()
    for name, p in model.named_parameters():
        assert p.ds_shape == shapes[name] and p.ds_numel == shapes[name].numel()
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.ds_tensor is None
        ids.add(p.ds_id)
    assert len(ids) == len(shapes)
    # DeepSpeed-Chat's save_zero_three_model: gather what has ds_id and is not available.
    weights = engine.parameters_fp32()
    saved = {}
    for name, p in model.named_parameters():
        fetch = [p] if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE else []
        with deepspeed.zero.GatheredParameters(fetch, enabled=True):
            saved[name] = p.data.cpu().clone()
    for name, value in saved.items():
        assert torch.equal(value, weights[name]), name


def test_zero_init_marks_the_parameters_it_builds():
    with deepspeed.zero.Init(config_dict_or_path=CFG):
        model = torch.nn.Linear(5, 3)
    assert model.weight.ds_numel == 15 and model.weight.ds_shape == torch.Size([3, 5])
    before = model.weight.ds_id
    deepspeed.initialize(model=model, config=CFG)
    assert model.weight.ds_id == before  # (the engine keeps zero.Init's ids)


def test_gathered_parameters_registers_fwd_modules_external_parameters():
    # DeepSpeed: GatheredParameters(params, fwd_module=m) registers params as m's
    # external parameters (tidal.register_external_parameter).
    from tidal.engine.external import marked_external
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with deepspeed.zero.GatheredParameters([net[0].weight], fwd_module=net[1]):
        pass
    assert [p is net[0].weight for p in marked_external(net[1])] == [True]
    assert marked_external(net[0]) == []


# --- transformers' DeepSpeed integration (tidal/_deepspeed_compat/hf_guard.py) ------

def test_trainingarguments_deepspeed_names_tidals_trainer_instead_of_a_missing_package(tmp_path):
    # Without the real DeepSpeed, transformers fails inside its version check
    # (PackageNotFoundError); with tidal.deepspeed imported the error names tidal's way.
    assert importlib.util.find_spec("deepspeed") is None  # (the case the guard acts in)
    from transformers import TrainingArguments
    from transformers.integrations import HfDeepSpeedConfig
    with pytest.raises(UsageError, match="needs the real DeepSpeed package, which is not "
                                         "installed.*tidal.integrations.TidalTrainer"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed=dict(CFG), report_to=[])
    with pytest.raises(UsageError, match="for a model built under HfDeepSpeedConfig.*"
                                         "tidal.deepspeed.zero.Init"):
        HfDeepSpeedConfig({"zero_optimization": {"stage": 3}})
    # Without deepspeed= nothing changes.
    assert TrainingArguments(output_dir=str(tmp_path), report_to=[]).deepspeed is None
