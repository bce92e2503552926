"""AT2's trained per-head weights: <model>.npz and its provenance <model>.json (`ctxmix at2-train`)."""
