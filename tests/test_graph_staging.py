"""The host side of a decode-graph step (`HostStaging`): input layout, padding, and page-table copies
skipped only when the device table already holds the rows. CPU (no pinned memory needed)."""

from __future__ import annotations

import torch

from pieceworks.executor.cuda_graph import HostStaging
from pieceworks.executor.inputs import page_table


def test_fill_lays_out_ids_positions_slots_and_pads():
    st = HostStaging(max_bs=8, width=4, pin=False)
    host = st.fill(4, [11, 12, 13], [5, 6, 7], [50, 61, 72], pad_slot=3)
    assert host.shape == (12,)
    assert host.view(3, 4).tolist() == [[11, 12, 13, 0], [5, 6, 7, 1], [50, 61, 72, 3]]
    # a smaller bucket afterwards uses the leading entries as its own [3, bs]
    host = st.fill(1, [9], [2], [40], pad_slot=3)
    assert host.view(3, 1).tolist() == [[9], [2], [40]]


def test_table_rows_copied_only_when_a_row_changes():
    st = HostStaging(max_bs=4, width=3, pin=False)
    seq_a, seq_b = [4, 7], [9]
    first = st.table_rows([seq_a, seq_b], fill=0)
    assert first is not None and torch.equal(first, page_table([[4, 7], [9]], 3, fill=0))
    assert st.table_rows([seq_a, seq_b], fill=0) is None  # unchanged: no copy
    assert st.table_rows([seq_a], fill=0) is None  # a smaller bucket: its rows are already there
    seq_b.append(2)  # the sequence gained a page (the runner passes the live page lists)
    changed = st.table_rows([seq_a, seq_b], fill=0)
    assert changed is not None and changed.tolist() == [[4, 7, 0], [9, 2, 0]]
    assert st.table_rows([seq_a, seq_b, [1]], fill=0) is not None  # a row the device never got
    assert st.table_rows([[5, 7], seq_b], fill=0) is not None  # same length, different page
    st.forget_table()
    assert st.table_rows([[5, 7], seq_b], fill=0) is not None  # capture overwrote the device table
