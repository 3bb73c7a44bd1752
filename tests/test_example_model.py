"""The example GPT trains under TP x PP x DP, checkpoints, and resumes under other layouts.

A run at TP2xPP2xDP2 (8 ranks) trains 3 steps, saves, and trains 3 more: those 3 losses are the
uninterrupted reference. Resuming from the checkpoint must give the same next losses: bitwise
under the same layout, and within LOSS_RTOL (1e-5 relative) under another one, where TP and DP
change the order of floating-point sums. Both optimizers are covered: Adam (states shaped like
the params) and DistributedAdam (flat DP slices), including loading one's checkpoint into the other.
"""

from __future__ import annotations

import pytest
import torch

import distckpt
from distckpt.dict_utils import nested_values
from distckpt.examples.model import GPTConfig, GPTModel
from distckpt.examples.optimizers import AdamKernel
from distckpt.examples.parallel import Layout, ParallelState
from distckpt.examples.training import (
    LOSS_RTOL,
    TrainConfig,
    last_stage_losses,
    losses_match,
    run,
)
from distckpt.utils import extract_sharded_tensors_and_factories
from tests.support.harness import run_ranks
from tests.support.train_script import load_train_script

SAVE_LAYOUT = Layout(tp=2, pp=2, dp=2)
STEPS_BEFORE_SAVE = 3
STEPS_AFTER_SAVE = 3
OPTIMIZERS = {"adam": TrainConfig(), "distributed": TrainConfig(distributed_optimizer=True)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """optimizer name -> (checkpoint dir, losses of the uninterrupted run after the save)."""
    out = {}
    for name, cfg in OPTIMIZERS.items():
        ckpt = tmp_path_factory.mktemp(f"ckpt-{name}")
        results = run_ranks(
            SAVE_LAYOUT.world_size,
            run,
            SAVE_LAYOUT,
            STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE,
            cfg,
            None,
            str(ckpt),
            STEPS_BEFORE_SAVE,
        )
        out[name] = (str(ckpt), last_stage_losses(results)[STEPS_BEFORE_SAVE:])
    return out


def _resume(saved, saved_with: str, layout: Layout, resume_with: str):
    ckpt, reference = saved[saved_with]
    results = run_ranks(layout.world_size, run, layout, STEPS_AFTER_SAVE, OPTIMIZERS[resume_with], ckpt)
    assert {(r.first_iteration, r.resumed_from) for r in results} == {(STEPS_BEFORE_SAVE, str(SAVE_LAYOUT))}
    return reference, last_stage_losses(results)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resuming_under_the_same_layout_is_bitwise_exact(saved, optimizer):
    reference, resumed = _resume(saved, optimizer, SAVE_LAYOUT, optimizer)
    assert resumed == reference


RESHARDED = [
    # (saved with, resumed at, resumed with)
    ("adam", Layout(tp=1, pp=1, dp=1), "adam"),
    ("distributed", Layout(tp=1, pp=1, dp=1), "distributed"),
    ("adam", Layout(tp=4, pp=1, dp=2), "adam"),
    ("distributed", Layout(tp=4, pp=1, dp=2), "distributed"),  # flat slices cut anew over TP4 x DP2
    ("distributed", Layout(tp=2, pp=1, dp=1), "adam"),  # flat slices into whole tensors
    ("adam", Layout(tp=2, pp=1, dp=1), "distributed"),  # whole tensors into flat slices
]


@pytest.mark.parametrize("case", RESHARDED, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_resuming_under_another_layout_matches_within_tolerance(saved, case):
    saved_with, layout, resume_with = case
    reference, resumed = _resume(saved, saved_with, layout, resume_with)
    assert losses_match(reference, resumed, LOSS_RTOL), (reference, resumed)


def test_training_lowers_the_loss(saved):
    _, losses = saved["adam"]
    first = run_ranks(1, run, Layout(), 1, OPTIMIZERS["adam"])[0].losses[0]
    assert losses[-1] < first


def test_distributed_optimizer_checkpoint_holds_whole_state_tensors(saved):
    adam = distckpt.load_plain_tensors(saved["adam"][0])
    flat = distckpt.load_plain_tensors(saved["distributed"][0])
    assert set(adam) == set(flat)
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
    cfg = GPTConfig()
    assert flat[key].shape == (cfg.num_layers, 2 * cfg.ffn_hidden_size, cfg.hidden_size)
    for k in adam:
        torch.testing.assert_close(flat[k], adam[k], rtol=1e-5, atol=1e-7, msg=k)


def test_checkpoint_keys_and_shapes_do_not_depend_on_the_layout(saved):
    cfg = GPTConfig()
    shapes = {k: tuple(v.global_shape) for k, v in distckpt.load_tensors_metadata(saved["adam"][0]).items()}
    h, f, v, layers = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.num_layers
    assert shapes["embedding.word_embeddings.weight"] == (v, h)
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == (layers, 3 * h, h)
    assert shapes["decoder.layers.self_attention.linear_proj.weight"] == (layers, h, h)
    assert shapes["decoder.layers.mlp.linear_fc1.weight"] == (layers, 2 * f, h)
    assert shapes["decoder.layers.mlp.linear_fc1.bias"] == (layers, 2 * f)
    assert shapes["output_layer.weight"] == (v, h)
    assert shapes["optimizer.state.exp_avg_sq.decoder.layers.input_layernorm.weight"] == (layers, h)


def test_sharded_state_dict_covers_every_parameter_once():
    ps = ParallelState.initialize(Layout())
    model = GPTModel(GPTConfig(), ps)
    sharded = model.sharded_state_dict()
    assert set(sharded) == set(model.state_dict())
    leaves, _ = extract_sharded_tensors_and_factories(sharded)
    params = {id(p) for p in model.parameters()}
    assert sorted(id(leaf.data) for leaf in nested_values(leaves)) == sorted(params)


def test_saved_fc1_is_w_then_v_whatever_the_tp(saved):
    """The fused SwiGLU weight is stored as [W; V], so TP4 and TP1 split it the same way."""
    cfg = GPTConfig()
    plain = distckpt.load_plain_tensors(saved["adam"][0])["decoder.layers.mlp.linear_fc1.weight"]
    tp1 = run_ranks(1, _fc1_of_layer0, saved["adam"][0], Layout(tp=1))[0]
    assert torch.equal(tp1, plain[0])
    tp4 = run_ranks(8, _fc1_of_layer0, saved["adam"][0], Layout(tp=4, dp=2))[:4]  # DP rank 0
    f = cfg.ffn_hidden_size
    w = torch.cat([t[: f // 4] for t in tp4])
    v = torch.cat([t[f // 4 :] for t in tp4])
    assert torch.equal(torch.cat([w, v]), plain[0])


def _fc1_of_layer0(ckpt: str, layout: Layout) -> torch.Tensor:
    from distckpt.examples.optimizers import Adam
    from distckpt.examples.training import load_checkpoint

    ps = ParallelState.initialize(layout)
    model = GPTModel(GPTConfig(), ps)
    load_checkpoint(ckpt, model, Adam(model, ps))
    return model.decoder.layers[0].mlp.linear_fc1.weight.detach().clone()


def test_layouts_read_from_the_command_line_and_order_ranks_tp_first():
    assert Layout.parse("TP2xPP2xDP2") == Layout.parse("2,2,2") == Layout(2, 2, 2)
    assert Layout.parse("tp4") == Layout(tp=4)
    layout = Layout(tp=2, pp=2, dp=2)
    assert [layout.coords(r) for r in (0, 1, 2, 4)] == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (0, 1, 0)]
    assert (
        layout.tp_groups()[0] == [0, 1]
        and layout.dp_groups()[0] == [0, 2]
        and layout.pp_groups()[0] == [0, 4]
    )
    with pytest.raises(ValueError, match="cannot read a layout"):
        Layout.parse("TP2xQQ3")


@pytest.mark.slow
def test_train_script_resumes_and_reports_matching_losses(tmp_path, capsys):
    script = load_train_script()
    argv = [
        "--layout",
        "1,1,1",
        "--resume-layout",
        "TP1",
        "--steps",
        "1",
        "--resume-steps",
        "1",
        "--optimizer",
        "adam",
        "--dir",
        str(tmp_path / "ckpt"),
    ]
    assert script.main(argv) == 0
    assert "losses match bitwise" in capsys.readouterr().out


def test_example_adam_computes_the_same_bits_as_torch_adam():
    g = torch.Generator().manual_seed(0)
    ours = [
        torch.nn.Parameter(torch.randn(5, 3, generator=g)),
        torch.nn.Parameter(torch.randn(7, generator=g)),
    ]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kernel = AdamKernel(ours, lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    reference = torch.optim.Adam(theirs, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, foreach=False)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        for p, q, grad in zip(ours, theirs, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        kernel.step()
        reference.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(kernel.state[p][name], reference.state[q][name])
    ours_sd, theirs_sd = kernel.state_dict(), reference.state_dict()
    assert set(ours_sd["state"]) == set(theirs_sd["state"])
    assert ours_sd["param_groups"][0]["params"] == theirs_sd["param_groups"][0]["params"]


@pytest.mark.slow
def test_train_script_restarts_from_the_local_tier(tmp_path, capsys):
    script = load_train_script()
    argv = [
        "--layout",
        "1,1,1",
        "--optimizer",
        "adam",
        "--steps",
        "3",
        "--resume-steps",
        "1",
        "--local-every",
        "1",
        "--persistent-every",
        "2",
        "--replication-factor",
        "1",
        "--dir",
        str(tmp_path),
    ]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert "restarted from the local checkpoint at iteration 3" in out and "losses match bitwise" in out
