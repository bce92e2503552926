"""Image explanations read as images: a map's row over the grid of patches (`patch_values`), and the position of
a patch (`position_of`). An image's positions are its prefix tokens (the class token, registers), then one patch
per grid cell row by row (`ctxmix.engine.inputs.ImageInput`); `Explanation.options["image"]` records the grid."""

from __future__ import annotations

import numpy as np

from ctxmix.errors import BadInput
from ctxmix.methods.explanation import map_row


def _grid(ex) -> tuple[int, tuple[int, int]]:
    img = (ex.options or {}).get("image")
    if not img:
        raise BadInput("this explanation is not of an image (no options['image'])")
    return int(img["prefix"]), (int(img["grid"][0]), int(img["grid"][1]))


def position_of(ex, row: int, col: int) -> int:
    """The position of the patch at grid cell (row, col), 0-based."""
    prefix, (rows, cols) = _grid(ex)
    if not (0 <= row < rows and 0 <= col < cols):
        raise BadInput(f"cell ({row}, {col}) is outside the {rows} x {cols} grid of patches")
    return prefix + row * cols + col


def patch_values(
    ex, method: str, position: int | None = None, layer: int | None = None
) -> tuple[dict[str, float], np.ndarray]:
    """Row `position` (default: the explanation's) of `method`'s aggregated map, or of layer `layer`'s map
    (1-based), as ({prefix token: value}, (rows, cols) values of the patches)."""
    prefix, (rows, cols) = _grid(ex)
    v = map_row(ex, method, position, layer)
    return dict(zip(ex.tokens[:prefix], map(float, v[:prefix]))), v[prefix:].reshape(rows, cols)


def region_values(
    ex, method: str, regions: tuple[int, int] = (2, 2), position: int | None = None, layer: int | None = None
) -> np.ndarray:
    """Row `position` of `method`'s map (as `patch_values`) gathered into a coarser grid of (rows, cols) regions:
    each region's value is the sum over the patches it covers (grid rows and columns split as evenly as they go,
    the first regions taking the extra patch). The regions' values sum to the patches' share of the row."""
    _, grid = patch_values(ex, method, position, layer)
    R, C = regions
    rows, cols = grid.shape
    if isinstance(R, bool) or isinstance(C, bool) or not (1 <= R <= rows and 1 <= C <= cols):
        raise BadInput(f"regions must be (rows, cols) within the {rows} x {cols} grid of patches, got {regions!r}")
    row_parts = np.array_split(np.arange(rows), R)
    col_parts = np.array_split(np.arange(cols), C)
    return np.array([[grid[np.ix_(r, c)].sum() for c in col_parts] for r in row_parts])
