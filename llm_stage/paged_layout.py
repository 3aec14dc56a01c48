"""A step's paged-KV metadata in the CSR form paged attention kernels read (FlashInfer's).

For each item, in step order: its query rows (``qo_indptr``), the pages holding its tokens
``[0, end)`` (``kv_indptr`` into ``kv_indices``), how full its last page is
(``last_page_len``), and the cache slot of each row it computes this step (``slots``). Pure
Python over block tables, so it is tested on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmcache.llm_stage.scheduler import StepItem


@dataclass(frozen=True, slots=True)
class PagedLayout:
    qo_indptr: list[int]  # (items + 1,) query rows of item i: [qo_indptr[i], qo_indptr[i + 1])
    kv_indptr: list[int]  # (items + 1,) pages of item i: kv_indices[kv_indptr[i] : kv_indptr[i + 1]]
    kv_indices: list[int]  # block ids
    last_page_len: list[int]  # (items,) tokens in each item's last page, 1..block_size
    slots: list[int]  # (rows,) cache slot written by each row

    @property
    def num_items(self) -> int:
        return len(self.last_page_len)

    def padded(self, batch: int, pad_block: int, block_size: int) -> PagedLayout:
        """The layout of single-token items padded to ``batch`` items with dummies: each reads and
        writes one slot of ``pad_block``, a block no sequence owns (what they compute is dropped)."""
        extra = batch - self.num_items
        if extra < 0:
            raise ValueError(f"cannot pad {self.num_items} items to a batch of {batch}")
        if len(self.slots) != self.num_items:
            raise ValueError("only single-token (decode) items are padded")
        rows, pages = self.qo_indptr[-1], self.kv_indptr[-1]
        return PagedLayout(
            qo_indptr=self.qo_indptr + [rows + i for i in range(1, extra + 1)],
            kv_indptr=self.kv_indptr + [pages + i for i in range(1, extra + 1)],
            kv_indices=self.kv_indices + [pad_block] * extra,
            last_page_len=self.last_page_len + [1] * extra,
            slots=self.slots + [pad_block * block_size] * extra,
        )


def paged_layout(items: list[StepItem], block_size: int) -> PagedLayout:
    qo_indptr, kv_indptr = [0], [0]
    kv_indices: list[int] = []
    last_page_len: list[int] = []
    slots: list[int] = []
    for item in items:
        table, start, end = item.seq.block_table, item.start, item.end
        pages = -(-end // block_size)
        if len(table) < pages:
            raise ValueError(f"block table holds {len(table)} blocks, tokens [0, {end}) need {pages}")
        kv_indices += table[:pages]
        kv_indptr.append(len(kv_indices))
        last_page_len.append(end - (pages - 1) * block_size)
        qo_indptr.append(qo_indptr[-1] + end - start)
        slots += [table[t // block_size] * block_size + t % block_size for t in range(start, end)]
    return PagedLayout(qo_indptr, kv_indptr, kv_indices, last_page_len, slots)
