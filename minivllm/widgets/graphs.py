"""A CUDA-graph decode step as the graph sees it: static buffers, real rows first, then padding."""

from __future__ import annotations

PAD_STYLE = "background:#eeeeee;color:#888888;text-align:center"
ROW_STYLE = "background:#dbe9f6;text-align:center"


def graph_batch_html(graphs) -> str:
    """One column per row of the batch `graphs` (a runner's DecodeGraphs) replayed last.

    The step had n requests and replayed the graph recorded for the next size up; the last size - n
    columns are padding: they store nothing (slot -1) and attend to one position (context length 1).
    """
    if graphs.last_replay is None:
        return "<p><i>no decode step has gone through the graphs yet</i></p>"
    n, size = graphs.last_replay
    fields = {"input token": graphs.input_ids, "position": graphs.positions,
              "cache slot": graphs.slot_mapping, "context length": graphs.seq_lens,
              "first block": graphs.block_tables[:, 0]}
    head = "".join(f"<th>row {i}{' (pad)' if i >= n else ''}</th>" for i in range(size))
    rows = []
    for name, buffer in fields.items():
        cells = "".join(f'<td style="{PAD_STYLE if i >= n else ROW_STYLE}">{value}</td>'
                        for i, value in enumerate(buffer[:size].tolist()))
        rows.append(f"<tr><th>{name}</th>{cells}</tr>")
    caption = (f"{n} requests decoding, replayed through the graph for batch size {size} "
               f"({size - n} padding rows)")
    return (f'<table class="minivllm-graph-batch"><caption>{caption}</caption>'
            f"<tr><th></th>{head}</tr>{''.join(rows)}</table>")
