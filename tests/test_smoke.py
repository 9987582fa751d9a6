import megatron_rl


def test_import():
    assert megatron_rl.__version__
