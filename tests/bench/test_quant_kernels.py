"""python -m bench.quant_kernels on CPU: one small run prints every column, ours included."""
from bench.quant_kernels import main
from nightshift.engine.quant import cpu_w4a8


def test_cpu_run_prints_each_kernel_per_step_size(capsys):
    main(["--rows", "1,16", "--layers", "1", "--repeats", "1", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["M", "int4", "tinygemm", "dense", "cached", "dense", "dequant", "dense", "fp32",
                                "fp32", "math", "w4a8"]
    for line, rows in zip(lines[2:], ("1", "16")):
        cells = line.split()
        assert cells[0] == rows and len(cells) == 7
        assert all(float(c) > 0 for c in cells[1:6])
        assert (float(cells[6]) > 0) if cpu_w4a8.available() else cells[6] == "-"
