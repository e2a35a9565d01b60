"""MindSpeed's MoE overlap switches in the job's argument check: --moe-alltoall-overlap-comm and
--moe-permutation-async-comm are the backend's overlap scheduler planning with the MoE token counts (rule
moe_token_hints, tests/passes/test_moe_overlap.py), refused where they cannot mean that; --moe-fb-overlap refused
with its reason (docs/moe.md, "Overlap of the token communication")."""

from pretrain_runs import parse_error, parse_tiny

MOE = ["--num-experts", "4", "--disable-bias-linear"]
A2A_EP2 = [*MOE, "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2"]


def test_moe_overlap_flags_turn_the_token_hints_on(megatron_cpu):
    args = parse_tiny(*A2A_EP2, "--moe-alltoall-overlap-comm", "--moe-permutation-async-comm", world_size=2)
    assert args.moe_alltoall_overlap_comm and args.moe_permutation_async_comm
    assert args.npu_compile_options == {}  # fusions "all": the rule is on, overlap on
    args = parse_tiny(*A2A_EP2, "--moe-alltoall-overlap-comm", "--npu-compile-options", '{"fusions": ["attention"]}',
                      world_size=2)
    assert args.npu_compile_options["fusions"] == ["attention", "moe_token_hints"]
    args = parse_tiny(*MOE, "--moe-permutation-async-comm", "--npu-compile-options",
                      '{"fusions": {"moe_token_hints": false}}')
    assert args.npu_compile_options["fusions"] == {"moe_token_hints": True}


def test_moe_overlap_flags_refused_where_they_cannot_mean_it(megatron_cpu):
    assert parse_error(*MOE, "--moe-alltoall-overlap-comm", "--expert-model-parallel-size", "2",
                       world_size=2).endswith(
        "--moe-alltoall-overlap-comm overlaps the all-to-all dispatcher's token exchange, as MindSpeed's (alltoall "
        "or alltoall_seq); this job's --moe-token-dispatcher-type is 'allgather'")
    assert parse_error(*MOE, "--moe-alltoall-overlap-comm", "--moe-token-dispatcher-type", "alltoall").endswith(
        "--moe-alltoall-overlap-comm overlaps the token all-to-all, which --expert-model-parallel-size 1 does not "
        "have (MindSpeed refuses it there too); give an expert-parallel size above 1 or drop it")
    assert parse_error(*MOE, "--moe-permutation-async-comm", "--no-npu-compile").endswith(
        "--moe-permutation-async-comm is the backend's overlap scheduler (planning with the MoE token counts: rule "
        "moe_token_hints), which --no-npu-compile turns off; drop one of them")
    assert parse_error(*A2A_EP2, "--moe-alltoall-overlap-comm", "--npu-compile-options", '{"overlap": false}',
                       world_size=2).endswith(
        "--moe-alltoall-overlap-comm is the backend's overlap scheduler (npu_compile option overlap), but "
        "--npu-compile-options gives overlap=false; drop one of them")
    message = parse_error(*A2A_EP2, "--moe-fb-overlap", world_size=2)
    assert "--moe-fb-overlap: MindSpeed's forward/backward overlap of two micro-batches" in message
    assert "no graph holds both" in message
