"""`python -m minivllm generate`: the command `make demo` runs, with every shared engine flag."""

from minivllm.__main__ import main


def test_generate_with_journey(capsys):
    code = main(["generate", "Hi, my name is", "Hello there", "--max-tokens", "6", "--journey",
                 "--enforce-eager", "--num-kv-blocks", "64", "--attention-backend", "torch"])
    out = capsys.readouterr().out
    assert code == 0
    assert "'Hi, my name is' -> " in out and "'Hello there' -> " in out and "(length)" in out
    assert "step" in out and "finished" in out  # the journey: what each engine step did


def test_bad_input_is_a_clear_error(capsys):
    assert main(["generate", "Hello", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "Hello", "--speculative-model", "[ngram]"]) == 2  # k missing
    assert "num_speculative_tokens" in capsys.readouterr().err
