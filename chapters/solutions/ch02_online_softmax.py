"""Reference solution, chapter 02: one block's step of the online softmax."""

import torch


def my_online_softmax_update(m, l, acc, scores, v):  # noqa: E741
    m_new = torch.maximum(m, scores.amax(dim=-1))  # the running maximum, this block included
    correction = torch.exp(m - m_new)  # rescales what was summed under the old maximum (0 at the start)
    p = torch.exp(scores - m_new[:, None])  # [H, n], never larger than 1: no overflow
    l_new = l * correction + p.sum(dim=-1)
    acc_new = acc * correction[:, None] + torch.einsum("hn,hnd->hd", p, v)
    return m_new, l_new, acc_new
