"""A parameter used only through expand/view by a module that reads it from a
child's ParameterList: Hugging Face Reformer's axial position embeddings.

In the first step the engine learns the read (Note [External parameters]) but
hooks the reading module only from the next forward, so in that step's
backward nothing brought the parameter in and autograd accumulated its
gradient against the empty placeholder: torch's "size of tensor a (0) must
match" instead of training. Against plain PyTorch + torch.optim.AdamW, at a
budget where chunks move.
"""
import copy

import torch
import transformers

import tidal

LR = 1e-3


def test_reformer_axial_position_embeddings_train_as_in_plain_pytorch():
    cfg = transformers.ReformerConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        axial_pos_shape=[4, 4], axial_pos_embds_dim=[16, 16], max_position_embeddings=16,
        feed_forward_size=64, attn_layers=["local", "local"], is_decoder=True,
        local_attn_chunk_length=4, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
        axial_norm_std=1.0)
    torch.manual_seed(0)
    model = transformers.ReformerModelWithLMHead(cfg)
    ref = copy.deepcopy(model)
    engine = tidal.initialize(model, {
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "tidal": {"device": "sim", "chunk_size": "16KiB", "device_memory_budget": "400KiB",
                  "device_margin": "4KiB", "simulated_allocator": "exact"}})
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item())
    got = engine.state_dict()
    for k, v in ref.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert engine.memory_report()["evictions"] > 0
