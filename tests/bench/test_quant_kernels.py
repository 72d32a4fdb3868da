"""python -m bench.quant_kernels on CPU: one small run prints every column, ours included."""
from bench.quant_kernels import main
from nightshift.engine.layers import cpu_math
from nightshift.engine.quant import cpu_w4_bf16, cpu_w4a8


def test_cpu_run_prints_each_kernel_per_step_size(capsys):
    main(["--rows", "1,16", "--layers", "1", "--repeats", "1", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["M", "int4", "tinygemm", "dense", "cached", "dense", "dequant", "dense", "fp32",
                                "fp32", "math", "bf16", "math", "w4a8", "w4a8", "avx2", "w4", "bf16"]
    for line, rows in zip(lines[2:], ("1", "16")):
        cells = line.split()
        assert cells[0] == rows and len(cells) == 10
        assert all(float(c) > 0 for c in cells[1:6])
        for cell, runs in ((cells[6], "bf16" in cpu_math.supported()), (cells[7], cpu_w4a8.available()),
                           (cells[8], cpu_w4a8.uses_vnni()),       # the AVX2 form beside the VNNI one
                           (cells[9], cpu_w4_bf16.available())):
            assert (float(cell) > 0) if runs else cell == "-"
