"""memory.png shows all it holds: nothing cut off at the image's edge, the legend off the curves."""

import pytest

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.legend import Legend  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from npu_compile.debug.plots import memory_png  # noqa: E402
from npu_compile.passes.memory import Buffer, Liveness  # noqa: E402

MIB = 2**20
# the demo's loss graph: its fused op's names are long, and its peak is near the right edge
NAME = "vocab_parallel_linear_cross_entropy_default"
OP = "npu_compile.vocab_parallel_linear_cross_entropy.default"


def liveness(peak_step, steps=11):
    curve = [MIB * (1 + (i == peak_step) * 11) for i in range(steps)]
    at_peak = [Buffer(f"{NAME}:workspace", OP, (), "uint8", 12 * MIB, peak_step, peak_step),
               *[Buffer(NAME, OP, (128, 4), "float32", 2048, 0, steps) for _ in range(2)],
               Buffer("clone", "aten.clone.default", (128, 4), "int64", 4096, 0, steps)]
    return Liveness(curve, max(curve), peak_step, at_peak)


@pytest.fixture
def saved(monkeypatch):
    """Each figure memory_png saves, drawn: (figure, renderer, the region the PNG holds, the region its drawn
    artists cover), regions in display pixels."""
    figures = []
    save = Figure.savefig

    def spy(fig, *args, **kwargs):
        renderer = fig.canvas.get_renderer()
        fig.draw(renderer)
        drawn = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # what matplotlib drew, all of it
        region = drawn if kwargs.get("bbox_inches") == "tight" else fig.bbox
        figures.append((fig, renderer, region, drawn))
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figures


@pytest.mark.parametrize("peak_step", [2, 8])
@pytest.mark.parametrize("boundary", [7, None])
def test_nothing_drawn_is_cut_off_and_the_legend_is_off_the_curves(saved, peak_step, boundary):
    png = memory_png(liveness(peak_step), liveness(peak_step), boundary, "graph 2_0: live bytes, backward")
    assert png.startswith(b"\x89PNG")
    ((fig, renderer, region, drawn),) = saved
    assert (drawn.x0 >= region.x0 - 1 and drawn.y0 >= region.y0 - 1 and drawn.x1 <= region.x1 + 1
            and drawn.y1 <= region.y1 + 1), f"drawn {drawn} but saved {region}"
    assert region.width <= 1.1 * fig.bbox.width  # the layout fits the figure; the tight box only trims its margins
    texts = [t.get_text() for t in fig.findobj(Text) if t.get_visible()]
    assert any(NAME in t and "12.00 MiB" in t for t in texts)  # the peak's buffers are listed, sizes and all
    (legend,) = fig.findobj(Legend)
    assert len(legend.get_texts()) == (4 if boundary is not None else 3)
    curves = [ax for ax in fig.axes if ax.lines]
    assert curves and not any(legend.get_window_extent(renderer).overlaps(ax.bbox) for ax in curves)
