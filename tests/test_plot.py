"""python -m llm.plot DIR: a run's main.log drawn with matplotlib; one line and exit 1 when it cannot be."""
import struct
import subprocess
import sys

from conftest import env
from llm import plot

MAIN_LOG = """s:0 tel:10.9921
s:0 trl:10.987654 lr:0.000100 norm:12.3456
s:1 trl:9.876543 lr:0.000200 norm:8.7654
s:2 trl:8.765432 lr:0.000300 norm:6.5432
s:2 tel:8.9012
s:2 eval:0.2500
s:3 trl:7.654321 lr:0.000400 norm:4.3210
s:4 tel:7.8901
s:4 eval:0.3333
"""
# blocks `import matplotlib` (a None in sys.modules makes the import fail) and then runs python -m llm.plot
WITHOUT_MATPLOTLIB = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'llm.plot'; "
                      "runpy.run_module('llm.plot', run_name='__main__')")


def run_dir(tmp_path, log=MAIN_LOG):
    (tmp_path / "run").mkdir()
    if log is not None:
        (tmp_path / "run" / "main.log").write_text(log)
    return tmp_path / "run"


def run_plot(args, cwd, python_args=("-m", "llm.plot")):
    return subprocess.run([sys.executable, *python_args, *args], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=60)


def png_size(path):
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_read_log_takes_train_val_and_hellaswag_lines(tmp_path):
    train, val, evals = plot.read_log(run_dir(tmp_path) / "main.log")
    assert train == [(0, 10.987654), (1, 9.876543), (2, 8.765432), (3, 7.654321)]
    assert val == [(0, 10.9921), (2, 8.9012), (4, 7.8901)]
    assert evals == [(2, 0.25), (4, 0.3333)]


def test_lines_that_are_not_log_lines_are_passed_over(tmp_path):
    """A value that is no number, or bytes that are no UTF-8, were a traceback once."""
    log = run_dir(tmp_path, log=None) / "main.log"
    log.write_bytes(b"s:0 trl:abc\n\xb6\xff\x00 garbage\ns:x tel:1\n" + MAIN_LOG.encode()
                    + b"s:5 tel:1.2.3\n")
    train, val, evals = plot.read_log(log)
    assert (len(train), len(val), len(evals)) == (4, 3, 2) and train[0] == (0, 10.987654)


def test_an_unreadable_main_log_is_one_line_and_exit_1(tmp_path):
    (run_dir(tmp_path, log=None) / "main.log").mkdir()
    proc = run_plot(["run"], cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr == "error: run/main.log: cannot read (Is a directory)\n"


def test_plot_writes_an_800_by_500_png(tmp_path, capsys):
    run = run_dir(tmp_path)
    assert plot.main([str(run)]) == 0
    assert png_size(run / "loss.png") == (800, 500)
    assert capsys.readouterr().out == (f"wrote {run / 'loss.png'}: 4 train and 3 val points, 2 HellaSwag "
                                       f"points\n")
    assert plot.main([str(run), "-o", str(tmp_path / "other.png")]) == 0
    assert png_size(tmp_path / "other.png") == (800, 500)
    assert plot.main([str(run), "-o", str(tmp_path / "new" / "folder" / "loss.png")]) == 0   # made for it
    assert png_size(tmp_path / "new" / "folder" / "loss.png") == (800, 500)


def test_an_image_name_without_a_suffix_gets_png_and_a_folder_is_refused(tmp_path, capsys):
    """matplotlib adds .png to a name without a suffix: the line names the file as written."""
    run = run_dir(tmp_path)
    assert plot.main([str(run), "-o", str(tmp_path / "curves")]) == 0
    assert png_size(tmp_path / "curves.png") == (800, 500)
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'curves.png'}: ")
    proc = run_plot(["run", "-o", "run"], cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr == "error: -o run: is a folder: name a file\n"
    assert sorted(p.name for p in run.iterdir()) == ["main.log"]


def test_figure_has_labelled_axes_a_legend_and_a_title():
    fig = plot.figure([(0, 4.0), (1, 3.5)], [(1, 3.6)], [(1, 0.26)], "run: loss against step")
    loss, acc = fig.axes
    assert (loss.get_xlabel(), loss.get_ylabel(), acc.get_ylabel()) == ("step", "loss", "HellaSwag accuracy")
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["train loss", "val loss",
                                                                     "HellaSwag accuracy"]
    assert [t.get_text() for t in fig.texts] == ["run: loss against step"]     # the figure's title
    assert loss.get_yscale() == "linear"
    assert len(plot.figure([(0, 4.0)], [], [], "t").axes) == 1     # no HellaSwag lines: no second axis


def test_log_flag_puts_loss_on_a_log_scale(tmp_path):
    run = run_dir(tmp_path)
    assert plot.figure([(0, 4.0), (1, 3.5)], [], [], "t", log_scale=True).axes[0].get_yscale() == "log"
    assert plot.main([str(run), "-o", str(tmp_path / "linear.png")]) == 0
    assert plot.main([str(run), "--log", "-o", str(tmp_path / "log.png")]) == 0
    assert png_size(tmp_path / "log.png") == (800, 500)
    assert (tmp_path / "log.png").read_bytes() != (tmp_path / "linear.png").read_bytes()


def test_missing_main_log_is_one_line_and_exit_1(tmp_path):
    run_dir(tmp_path, log=None)
    proc = run_plot(["run"], cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == "error: run/main.log: no such file (train with -o run first)\n"


def test_log_without_loss_lines_is_one_line_and_exit_1(tmp_path):
    run_dir(tmp_path, log="s:2 eval:0.2500\nsomething else\n")
    proc = run_plot(["run"], cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == "error: run/main.log: no s:N trl:/tel: lines to plot\n"
    assert not (tmp_path / "run" / "loss.png").exists()


def test_missing_matplotlib_is_one_line_and_exit_1(tmp_path):
    run_dir(tmp_path)
    proc = run_plot(["run"], cwd=tmp_path, python_args=("-c", WITHOUT_MATPLOTLIB))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == 'error: this needs the matplotlib package: pip install -e ".[plot]"\n'
    assert not (tmp_path / "run" / "loss.png").exists()


def test_importing_llm_plot_does_not_import_matplotlib(tmp_path):
    check = "import sys, llm, llm.plot; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    proc = run_plot([], cwd=tmp_path, python_args=("-c", check))
    assert proc.returncode == 0, proc.stderr
