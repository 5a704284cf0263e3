"""Expert LoRA on the routed tokens (`routed_lora.use_routed_lora`) against PEFT's own expert LoRA, in one
process, fp32, on CPU: the experts modules of the tiny Qwen3-MoE (gated, SiLU) and Nemotron-H (plain, ReLU^2)
twins with PEFT ``target_parameters`` LoRA (random A and B), for several routings, experts without tokens
included; the experts split over 2 forked EP ranks, one of which receives no token, against the unsharded ones;
and activation checkpointing of one part of each decoder layer (`moe_model.checkpoint_parts`) against none,
on the whole tiny Qwen3-MoE.

PEFT's reference runs transformers' ``eager`` experts (a loop over the experts hit) on the folded weights
W_e + s B_e A_e; the routed path runs grouped GEMMs (here the loop fallback of `routed_lora.grouped_mm`) on the
sorted tokens. Same math, other summation order: measured, the largest difference of each compared tensor is
under 1e-6 of its largest value (values ~1), so 1e-5 leaves a margin of 10; a wrong scaling, expert order or
missing LoRA term changes them by > 1e-2.
"""

import pytest
import torch
from conftest import ROOT, recipe_modules
from torch.utils._python_dispatch import TorchDispatchMode

import cookbook

expert_parallel, moe_model, routed_lora = recipe_modules(
    "moe-lora-fsdp2-ep", "expert_parallel", "moe_model", "routed_lora"
)

TINY = ROOT / "recipes" / "moe-lora-fsdp2-ep" / "tiny"
TOL = dict(rtol=1e-5, atol=1e-5)
TOKENS, EXPERTS, TOP_K = 12, 4, 2


def experts_with_lora(model: str, seed: int = 0):
    """(PEFT-wrapped experts module, its parent) of one MoE layer of the tiny model, LoRA r 4 with random
    factors (B != 0, so both factors get gradients), transformers' eager experts underneath."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = AutoConfig.from_pretrained(TINY / model)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    parent = torch.nn.Module()
    parent.experts = (Qwen3MoeExperts if model == "qwen3-moe" else NemotronHExperts)(config)
    for p in parent.experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
        p.requires_grad_(False)
    names = ["experts.gate_up_proj" if model == "qwen3-moe" else "experts.up_proj", "experts.down_proj"]
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_parameters=names), parent)
    for n, p in parent.named_parameters():
        if "lora_" in n:
            torch.nn.init.normal_(p, std=0.1)
    return parent.experts, parent


ROUTINGS = {  # (tokens, top-k) distinct expert ids per token
    "random": torch.stack(
        [torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(t))[:TOP_K] for t in range(TOKENS)]
    ),
    "tail-empty": torch.tensor([[0, 1], [1, 0]] * (TOKENS // 2)),  # experts 2 and 3 get no token
    "ends-empty": torch.tensor([[2, 1]] * TOKENS),  # experts 0 and 3 get no token
    "one-token": torch.tensor([[3, 0]]),  # experts 1 and 2 get no token
}


def run(module, hidden, index, weights, routed: bool, keep_grads: bool = False):
    """Output and the gradients (input, routing weights, every LoRA factor) of sum(out * probe); `keep_grads`:
    the parameters keep theirs."""
    hidden = hidden.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    out = (
        routed_lora.routed_experts_forward(module, hidden, index, weights) if routed else module(hidden, index, weights)
    )
    probe = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}
    if not keep_grads:
        for p in module.parameters():
            p.grad = None
    return out.detach(), hidden.grad, weights.grad, grads


class Shapes(TorchDispatchMode):
    """Records the shape of every new tensor an operator returns (views of its inputs left out)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.seen.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("model", ["qwen3-moe", "nemotron-h"])
@pytest.mark.parametrize("pattern", sorted(ROUTINGS))
def test_routed_lora_equals_peft(model, pattern):
    """Outputs and the gradients of the input, the routing weights and every LoRA factor."""
    module, _ = experts_with_lora(model)
    index = ROUTINGS[pattern]
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(len(index), module.get_base_layer().hidden_dim, generator=g)
    weights = torch.rand(index.shape, generator=g)
    expected = run(module, hidden, index, weights, routed=False)
    got = run(module, hidden, index, weights, routed=True)
    torch.testing.assert_close(got[0], expected[0], **TOL)
    torch.testing.assert_close(got[1], expected[1], **TOL)
    torch.testing.assert_close(got[2], expected[2], **TOL)
    assert sorted(got[3]) == sorted(expected[3]) and len(got[3]) == 4  # lora_A and lora_B of both projections
    for name, grad in expected[3].items():
        torch.testing.assert_close(got[3][name], grad, **TOL, msg=name)
        assert grad.abs().sum() > 0, name
    empty = sorted(set(range(EXPERTS)) - set(index.reshape(-1).tolist()))
    for name, grad in got[3].items():  # experts without tokens: zero gradient in their slices (rank 4)
        for e in empty:
            part = grad[e * 4 : (e + 1) * 4] if "lora_A" in name else grad.reshape(grad.shape[0], 4, EXPERTS)[:, :, e]
            assert part.abs().max() == 0, (name, e)


def zero_token_batch(rank: int, hidden_dim: int, receiver: int):
    """Rank `rank`'s tokens, all routed to the two experts of EP rank `receiver` (the other rank receives none)."""
    g = torch.Generator().manual_seed(10 + rank)
    index = torch.tensor([[0, 1], [1, 0]] * (TOKENS // 2)) + 2 * receiver
    return torch.randn(TOKENS, hidden_dim, generator=g), index, torch.rand(index.shape, generator=g)


ZERO_TOKEN_CASES = [(routed, receiver) for routed in (True, False) for receiver in (0, 1)]  # routed LoRA, PEFT's


@cookbook.distributed(num_processes=2, start_method="fork", timeout_minutes=1)  # a rank left waiting fails, not hangs
def _ep2_experts(cases: list) -> list:
    """For each (routed, receiver) of `cases`: one experts layer split over 2 EP ranks (`expert_parallel.split_experts`,
    `expert_parallel.ep_dispatch`), every token sent to EP rank `receiver`; this rank's output and input / routing-weight
    gradients, and the LoRA gradients of the unsharded layer (`expert_parallel.gather_lora`)."""
    results = []
    for routed, receiver in cases:
        module, block = experts_with_lora("qwen3-moe")
        block.gate = torch.nn.Identity()  # `expert_parallel.moe_blocks` finds a block by its router
        model = torch.nn.ModuleDict({"mlp": block})
        if routed:
            routed_lora.use_routed_lora(model)
        meshes = expert_parallel.init_meshes("cpu", 2, 2)
        meshes.expert_lora_names = expert_parallel.split_experts(model, meshes.dp_ep["ep"])
        batch = zero_token_batch(cookbook.get_dist_info().rank, module.get_base_layer().hidden_dim, receiver)
        out, dh, dw, _ = run(module, *batch, routed=False, keep_grads=True)  # its forward is now ep_dispatch
        grads = {
            n.removeprefix("mlp.experts."): g for n, g in expert_parallel.gather_lora(model, meshes, grads=True).items()
        }
        results.append((out, dh, dw, grads))
    return results


def test_ep2_rank_without_tokens_equals_the_unsharded_experts():
    """EP=2 where every token of both ranks goes to the experts of one EP rank, so the other computes on no token
    (either rank; routed LoRA and PEFT's forward): each rank's output and gradients (input, routing weights) and
    the LoRA gradients gathered from both ranks equal the unsharded layer's on the same tokens; the idle rank's
    experts get zero gradients, not none, and it joins every all-to-all of backward (else the other rank hangs)."""
    got = _ep2_experts.distributed(ZERO_TOKEN_CASES)
    module, _ = experts_with_lora("qwen3-moe")
    hidden_dim = module.get_base_layer().hidden_dim
    for case, (routed, receiver) in enumerate(ZERO_TOKEN_CASES):
        expected = [run(module, *zero_token_batch(rank, hidden_dim, receiver), routed=routed) for rank in (0, 1)]
        for rank in (0, 1):
            for tensor, reference in zip(got[rank][case][:3], expected[rank][:3]):
                torch.testing.assert_close(tensor, reference, **TOL, msg=f"{routed} {receiver} {rank}")
        grads, idle = got[0][case][3], 1 - receiver
        assert sorted(grads) == sorted(expected[0][3]) and len(grads) == 4
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[0][3][name] + expected[1][3][name], **TOL, msg=f"{routed} {name}")
            first = 2 * idle  # the idle rank's 2 experts, rank 4 each
            part = (
                grad[first * 4 : (first + 2) * 4]
                if "lora_A" in name
                else grad.reshape(grad.shape[0], 4, EXPERTS)[:, :, first : first + 2]
            )
            assert part.abs().max() == 0 and grad.abs().max() > 0, (routed, receiver, name)


@pytest.mark.parametrize("model", ["qwen3-moe", "nemotron-h"])
def test_routed_lora_builds_no_per_expert_weight_delta(model):
    """No operator of the routed forward and backward returns a tensor the shape of the expert weights
    (B_e @ A_e for every expert, W_e + delta, or a weight gradient); PEFT's forward does (the check can fail)."""
    module, _ = experts_with_lora(model)
    weight_shapes = {tuple(p.shape) for p in module.get_base_layer().parameters()}
    hidden = torch.randn(TOKENS, module.get_base_layer().hidden_dim)
    for routed in (True, False):
        with Shapes() as shapes:
            run(module, hidden, ROUTINGS["random"], torch.rand(TOKENS, TOP_K), routed=routed)
        assert bool(shapes.seen & weight_shapes) is not routed, (routed, shapes.seen & weight_shapes)


def test_use_routed_lora_switches_the_model_and_keeps_peft_names():
    """On the tiny Qwen3-MoE with PEFT: every MoE block switched, the same parameter names, the same logits as
    PEFT's forward; refused after the experts are split."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY / "qwen3-moe"))
    model = get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj"],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        ),
    )
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    ids = torch.arange(3, 40).unsqueeze(0)
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert routed_lora.use_routed_lora(model) == 2
    assert [n for n, _ in model.named_parameters()] == names
    with torch.no_grad():
        got = model(input_ids=ids).logits
        with model.disable_adapter():  # no LoRA when PEFT disables the adapters
            plain = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, **TOL)
    assert not torch.allclose(plain, expected, atol=1e-3)
    for _, block in expert_parallel.moe_blocks(model):
        block.experts.base_layer.base_layer.checkpoint_offset = 0
    with pytest.raises(ValueError, match="use_routed_lora must run before split_experts"):
        routed_lora.use_routed_lora(model)
    experts = expert_parallel.moe_blocks(model)[0][1].experts.get_base_layer()
    assert routed_lora.routed_lora_unsupported(experts) is None
    experts.has_bias = True
    assert routed_lora.routed_lora_unsupported(experts) == "have biases or a post-expert norm"
    assert "not transformers' fused experts" in routed_lora.routed_lora_unsupported(torch.nn.Linear(2, 2))


def tiny_qwen_with_lora(layers: int = 2):
    """The tiny Qwen3-MoE (`layers` MoE layers) with LoRA on q/v and the experts (B random), routed expert LoRA."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY / "qwen3-moe", num_hidden_layers=layers))
    model = get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        ),
    )
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    routed_lora.use_routed_lora(model)
    return model


@pytest.mark.parametrize("part, wrapped", [("attention", 2), ("experts", 2)])
def test_checkpoint_parts_recomputes_and_keeps_the_gradients(part, wrapped):
    """The tiny Qwen3-MoE (2 layers) with routed LoRA: the same loss and LoRA gradients with one part of each
    layer checkpointed as with none, that part run again in backward (counted by a forward hook), names kept."""

    def step(model):
        calls = []
        layer = model.base_model.model.model.layers[0]
        probe = (
            layer.self_attn.k_proj if part == "attention" else layer.mlp.gate
        )  # a child: its hooks run in the recompute
        probe.register_forward_hook(lambda *_: calls.append(1))
        ids = torch.arange(3, 35).unsqueeze(0)
        loss = model(input_ids=ids, labels=ids).loss
        forward_calls = len(calls)
        loss.backward()
        return (
            loss.detach(),
            {n: p.grad for n, p in model.named_parameters() if p.requires_grad},
            forward_calls,
            len(calls),
        )

    plain = step(tiny_qwen_with_lora())
    model = tiny_qwen_with_lora()
    names = [n for n, _ in model.named_parameters()]
    assert moe_model.checkpoint_parts(model.base_model.model.model.layers, part) == wrapped
    assert [n for n, _ in model.named_parameters()] == names
    loss, grads, forward_calls, all_calls = step(model)
    assert (plain[2], plain[3]) == (1, 1)  # without checkpointing: one forward, nothing run in backward
    assert (forward_calls, all_calls) == (1, 2)  # checkpointed: run again in backward
    torch.testing.assert_close(loss, plain[0], rtol=0, atol=0)
    assert sorted(grads) == sorted(plain[1]) and any("experts" in n for n in grads)
    for name, grad in plain[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="part must be 'attention' or 'experts'"):
        moe_model.checkpoint_parts(model.base_model.model.model.layers, "full")


# ----------------------------------------------------------------------------- the grouped GEMM operator, torch.compile
GROUP_ROWS = {  # rows per group of 4: empty groups first, inside, last; all rows in one group
    "inner-empty": [3, 0, 2, 1],
    "ends-empty": [0, 4, 2, 0],
    "one-group": [0, 0, 5, 0],
    "no-empty": [1, 2, 1, 3],
}


def grouped_reference(x, w, rows):
    """Each row times its own group's matrix, an einsum over the per-row matrices: no slicing by offsets."""
    group = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))
    return torch.einsum("sk,skn->sn", x, w[group])


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("rows", sorted(GROUP_ROWS))
def test_grouped_mm_operator_equals_the_per_row_reference(rows, kernel, monkeypatch):
    """`routed_lora.grouped_mm` and the custom operator (with its backward) against the per-row reference: output and both
    gradients, weights given contiguous, as a transposed view (the experts' (E, out, in) weights) and as the
    expert-innermost view of lora_B that grouped GEMM refuses (copied). ``kernel``: the path that calls torch's
    grouped GEMM (CUDA bf16 in training; torch 2.13 also runs it on CPU in fp32, stride checks included), forced
    here on CPU; else the loop over groups. Empty groups get zero weight gradients."""
    if kernel:
        monkeypatch.setattr(routed_lora, "_kernel_ok", lambda x, k, n: len(x) > 0)
    counts = GROUP_ROWS[rows]
    offs = torch.cumsum(torch.tensor(counts), 0, dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    x0, dy = torch.randn(sum(counts), 8, generator=g), torch.randn(sum(counts), 16, generator=g)
    base = torch.randn(4, 8, 16, generator=g)
    layouts = {
        "contiguous": lambda t: t,
        "transposed": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),
        "expert-innermost": lambda t: t.permute(1, 2, 0).contiguous().permute(2, 0, 1),
    }
    for name, layout in layouts.items():
        results = []
        for fn in (
            lambda x, w, o: grouped_reference(x, w, counts),
            routed_lora.grouped_mm,
            torch.ops.cookbook.grouped_mm,
        ):
            x, w = x0.clone().requires_grad_(True), base.clone().requires_grad_(True)
            y = fn(x, layout(w), offs)
            (y * dy).sum().backward()
            results.append((y.detach(), x.grad, w.grad))
        for got in results[1:]:  # the wrapper (eager, kernel path: torch's own autograd) and the operator itself
            for tensor, expected in zip(got, results[0]):
                torch.testing.assert_close(tensor, expected, rtol=1e-5, atol=1e-5, msg=name)
            for e, n in enumerate(counts):
                assert bool(got[2][e].abs().max() == 0) == (n == 0), (name, e)
    torch.library.opcheck(torch.ops.cookbook.grouped_mm.default, (x0, base, offs))  # fake impl, autograd, schema
    torch.library.opcheck(torch.ops.cookbook.grouped_mm_weight_grad.default, (x0, dy, offs))


def loss_and_grads(model):
    ids = torch.arange(3, 35).unsqueeze(0)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_router_hooks_do_not_make_compiled_layers_recompile():
    """Compiled layers (``train.compile=layers``) whose MoE block resumes after a graph break, as at FSDP2's hooks
    on the experts module in the recipe (emulated here by a hook dynamo leaves eager): the routers'
    `RouterStats` hooks run inside that compiled code, and the number of compiled frames must not grow with the
    number of layers. A hook appending to a shared list made dynamo guard on the list's length, so each layer
    recompiled (measured on one H200: 48 layers hit dynamo's recompile limit of 8, the rest ran eager)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    frames = {}
    for layers in (2, 4):
        torch._dynamo.reset()
        model = tiny_qwen_with_lora(layers)
        router = moe_model.RouterStats(model)
        for _, block in expert_parallel.moe_blocks(model):
            block.experts.register_forward_pre_hook(torch.compiler.disable(lambda mod, args: None))
        backend = CompileCounterWithBackend("aot_eager")
        moe_model.compile_parts(model.base_model.model.model.layers, "layers", backend=backend)
        ids = torch.arange(3, 35).unsqueeze(0)
        for _ in range(2):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # no KV cache, as in training
            assert float(router.take()) > 0.5  # Switch aux loss: ~1 at balance, from every layer's router
        assert router.loads.sum().item() == 2 * layers * 32 * 2  # steps x layers x tokens x top_k slots counted
        frames[layers] = backend.frame_count
    assert frames[4] == frames[2], frames


@pytest.mark.parametrize("part, graphs", [("moe", 2), ("layers", 2)])
def test_compiled_parts_equal_eager(part, graphs):
    """`moe_model.compile_parts` on the tiny Qwen3-MoE, backend aot_eager (dynamo and AOTAutograd trace forward and
    backward as for inductor; inductor's C++ build takes ~40 s here): the same loss and LoRA gradients as eager,
    twice (the second step runs the cached code), no graph break, and the layers share their compiled code
    (moe: the router's graph and the routed experts' graph, `grouped_mm` in it as one operator; layers: the
    first layer's graph and the second's, whose input requires grad). aot_eager runs the same kernels as eager
    in the same order: measured, equal to the last bit."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = tiny_qwen_with_lora()
    eager_router = moe_model.RouterStats(eager)
    expected = loss_and_grads(eager)
    expected_aux = eager_router.take()
    model = tiny_qwen_with_lora()
    router = moe_model.RouterStats(model)  # its hooks run inside the compiled code: they must not make it recompile
    names = [n for n, _ in model.named_parameters()]
    backend = CompileCounterWithBackend("aot_eager")
    assert moe_model.compile_parts(model.base_model.model.model.layers, part, backend=backend) == (
        4 if part == "moe" else 2
    )
    assert [n for n, _ in model.named_parameters()] == names
    for _ in range(2):
        loss, grads = loss_and_grads(model)
        torch.testing.assert_close(loss, expected[0], rtol=0, atol=0)
        torch.testing.assert_close(router.take(), expected_aux, rtol=0, atol=0)
        assert sorted(grads) == sorted(expected[1]) and any("experts" in n for n in grads)
        for name, grad in expected[1].items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    assert backend.frame_count == graphs and not counters["graph_break"], (
        backend.frame_count,
        dict(counters["graph_break"]),
    )
    ops = {str(node.target) for gm in backend.graphs for node in gm.graph.nodes}
    assert any("cookbook.grouped_mm" in op for op in ops), sorted(ops)
    with pytest.raises(ValueError, match="part must be 'moe' or 'layers'"):
        moe_model.compile_parts(model.base_model.model.model.layers, "experts")
