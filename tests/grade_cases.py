"""Submissions the grader is tested with, as edits of the solution notebooks' solution cells.

BROKEN[assignment]: name -> (task, old, new): a deliberate bug in one task; its grade must fail
that task. CORRECT[assignment]: name -> [(old, new), ...]: a correct solution written
differently (or printing as it works); it must pass everything. FORBIDDEN[assignment]:
(task, old, new): a solution that hands the work to the library the task forbids; it must be
reported. Each ``old`` occurs exactly once in the notebook's solution cells.
"""

BROKEN = {
    "A1": {
        "stats without the block max": ("A1.1", "torch.exp(b - b.amax(-1, keepdim=True)).sum(-1)", "torch.exp(b).sum(-1)"),
        "stats drop the partial block": ("A1.1", "blocks = x.split(block_size, dim=-1)",
                                         "blocks = x[..., : max(block_size, x.shape[-1] // block_size * block_size)].split(block_size, dim=-1)"),
        "block sums not rescaled": ("A1.2", "l = (torch.exp(m_b - m) * l_b).sum(-1, keepdim=True)", "l = l_b.sum(-1, keepdim=True)"),
        "shift by the smallest block max": ("A1.2", "m = m_b.amax(-1, keepdim=True)", "m = m_b.amin(-1, keepdim=True)"),
        "running sum not rescaled": ("A1.3", "l = l * torch.exp(m - m_new) +", "l = l +"),
        "max updated before the sum": ("A1.3", "        l = l * torch.exp(m - m_new) + torch.exp(xb - m_new.unsqueeze(-1)).sum(-1)  # [...]\n        m = m_new\n",
                                       "        m = m_new\n        l = l * torch.exp(m - m_new) + torch.exp(xb - m_new.unsqueeze(-1)).sum(-1)  # [...]\n"),
        "values not rescaled": ("A1.4", "acc = alpha * acc + p @ vb", "acc = acc + p @ vb"),
        "logits not scaled": ("A1.4", "s = (kb @ q) * scale", "s = kb @ q"),
        "attention sum not rescaled": ("A1.4", "l = alpha * l + p.sum()", "l = l + p.sum()"),
    },
    "A2": {
        "allocate takes blocks before failing": ("A2.1", "        if n > len(self.free_list):\n            raise OutOfBlocks(n, len(self.free_list))\n        blocks = [self.free_list.pop() for _ in range(n)]",
                                                 "        blocks = []\n        for _ in range(n):\n            if not self.free_list:\n                raise OutOfBlocks(n, len(self.free_list))\n            blocks.append(self.free_list.pop())"),
        "allocate refuses when exactly enough": ("A2.1", "if n > len(self.free_list):", "if n >= len(self.free_list) and n:"),
        "freed blocks reused last (FIFO)": ("A2.1", "                self.free_list.append(b)", "                self.free_list.insert(0, b)"),
        "release not all or nothing": ("A2.1", "            if self.refs[b] == 0:\n                raise NotInUse(b, \"release\")\n", ""),
        "share not all or nothing": ("A2.1", "        for b in blocks:\n            if self.refs[b] == 0:\n                raise NotInUse(b, \"share\")\n", "        for b in blocks[:1]:\n            if self.refs[b] == 0:\n                raise NotInUse(b, \"share\")\n"),
        "release frees a shared block": ("A2.1", "            self.refs[b] -= 1\n            if self.refs[b] == 0:", "            self.refs[b] = 0\n            if True:"),
        "blocks_needed ignores the partial block": ("A2.2", "return -(-(self.num_tokens + n) // self.block_size) - len(self.blocks)", "return -(-n // self.block_size)"),
        "append counts tokens before allocating": ("A2.2", "        self.blocks += self.allocator.allocate(self.blocks_needed(n))\n        self.num_tokens += n",
                                                   "        needed = self.blocks_needed(n)\n        self.num_tokens += n\n        self.blocks += self.allocator.allocate(needed)"),
        "append takes blocks one at a time": ("A2.2", "        self.blocks += self.allocator.allocate(self.blocks_needed(n))\n",
                                              "        for _ in range(self.blocks_needed(n)):\n            self.blocks += self.allocator.allocate(1)\n"),
        "slot mapping forgets the block size": ("A2.2", "return [self.blocks[p // bs] * bs + p % bs", "return [self.blocks[p // bs] + p % bs"),
        "fork does not share": ("A2.3", "        self.allocator.share(self.blocks)\n        child", "        child"),
        "fork aliases the block list": ("A2.3", "child.blocks, child.num_tokens = self.blocks.copy(), self.num_tokens", "child.blocks, child.num_tokens = self.blocks, self.num_tokens"),
        "copies a full shared block": ("A2.3", "if self.num_tokens % self.block_size and pool.refcount(self.blocks[-1]) > 1:", "if self.blocks and pool.refcount(self.blocks[-1]) > 1:"),
        "copy keeps the source's user": ("A2.3", "            pool.release([src])  # the other sharers keep it\n", ""),
        "copy before checking the new blocks fit": ("A2.3", "            if needed > pool.num_free:\n                raise OutOfBlocks(needed, pool.num_free)\n", ""),
        "needed forgets the copy": ("A2.3", "needed = 1 + self.blocks_needed(n)", "needed = self.blocks_needed(n)"),
        "never copies": ("A2.3", "pool.refcount(self.blocks[-1]) > 1", "pool.refcount(self.blocks[-1]) > 2"),
        "free_table releases head first": ("A2.4", "table.allocator.release(table.blocks[::-1])", "table.allocator.release(table.blocks)"),
        "free_table leaves the table": ("A2.4", "    table.blocks, table.num_tokens = [], 0\n", ""),
        "violations only where a table points": ("A2.4", "        for b in range(allocator.num_blocks)\n", "        for b in sorted(entries)\n"),
        "violations unsorted and repeated": ("A2.4", "        for b in range(allocator.num_blocks)\n", "        for b in [*allocator.free_list, *range(allocator.num_blocks)]\n"),
        "violations miss a block listed twice": ("A2.4", "on_free_list[b] != (allocator.refs[b] == 0)", "(b in on_free_list) != (allocator.refs[b] == 0)"),
    },
    "A3": {
        "key ignores the parent": ("A3.1", "return hash((parent_key, tuple(tokens)))", "return hash(tuple(tokens))"),
        "key for a partial block": ("A3.1", "range(0, len(token_ids) - block_size + 1, block_size)", "range(0, len(token_ids), block_size)"),
        "insert overwrites a key": ("A3.2", "                if key in self.block_of:\n                    return  # another block holds this key: this one and the rest stay private\n", ""),
        "lookup trusts the key": ("A3.2", "if block_parent != parent or tokens != tuple(token_ids[i * bs : (i + 1) * bs]):", "if False:"),
        "lookup ignores the parent": ("A3.2", "if block_parent != parent or tokens", "if tokens"),
        "evicts the most recent": ("A3.3", "self.lru.popitem(last=False)", "self.lru.popitem(last=True)"),
        "eviction keeps the index entry": ("A3.3", "        self.index.forget(block)\n", ""),
        "hits the last prompt token": ("A3.3", "hits = self.index.lookup(token_ids)[: (n - 1) // bs]", "hits = self.index.lookup(token_ids)"),
        "needed forgets revived blocks": ("A3.3", "needed = num_fresh + sum(self.refs[b] == 0 for b in hits)", "needed = num_fresh"),
        "release head first": ("A3.3", "for b in reversed(blocks):", "for b in blocks:"),
        "parks uncached blocks": ("A3.3", "                if b in self.index.entry:", "                if True:"),
        "serve releases the newest": ("A3.4", "cache.release(live.pop(0))", "cache.release(live.pop())"),
    },
    "A4": {
        "gather by offset, not block": ("A4.1a", "blocks = block_table[t // block_size].long()", "blocks = block_table[t % block_size].long()"),
        "query heads interleaved": ("A4.1b", "q = query[i].float().view(num_kv_heads, group, head_dim)", "q = query[i].float().view(group, num_kv_heads, head_dim).transpose(0, 1)"),
        "scale ignored": ("A4.1b", "s = torch.einsum(\"kgd,nkd->kgn\", q, k) * scale", "s = torch.einsum(\"kgd,nkd->kgn\", q, k) * head_dim**-0.5"),
        "kernel ignores the block table": ("A4.2", "src = block_ids * stride_c_block + (tokens % BLOCK_SIZE) * stride_c_token", "src = tokens * stride_c_token"),
        "kernel does not mask the tail": ("A4.3", "        s = tl.where(tok_ok[None, :], s, float(\"-inf\"))\n", ""),
        "kernel does not rescale": ("A4.3", "acc = acc * alpha[:, None] +", "acc = acc +"),
        "merge without the max": ("A4.4", "w = torch.exp(lse - lse_max)", "w = torch.exp(lse)"),
        "merge unweighted": ("A4.4", "return (w[..., None] * parts).sum(dim=-2) / w.sum(dim=-1, keepdim=True)", "return parts.mean(dim=-2)"),
    },
    "A5": {
        "admission ignores the watermark": ("A5.1", "room = self.manager.num_free_blocks - self.watermark_blocks\n        if self.blocks_for(n) > room or len(self.running) + 1",
                                            "room = self.manager.num_free_blocks\n        if self.blocks_for(n) > room or len(self.running) + 1"),
        "admission ignores the seat cap": ("A5.1", "if self.blocks_for(n) > room or len(self.running) + 1 > self.max_num_seqs:\n            return\n        if n",
                                           "if self.blocks_for(n) > room:\n            return\n        if n"),
        "admission ignores the budget": ("A5.1", "if n > budget and step.batch:", "if False:"),
        "preempted request waits at the back": ("A5.2", "self.waiting.insert(later[0] if later else len(self.waiting), req)", "self.waiting.append(req)"),
        "preempts the earliest arrival": ("A5.2", "% bs == 0)\n        while need > self.manager.num_free_blocks and queue:\n            self.preempt(queue.pop(), step)",
                                                "% bs == 0)\n        while need > self.manager.num_free_blocks and queue:\n            self.preempt(queue.popleft(), step)"),
        "swapped queue not kept in arrival order": ("A5.3", "    self.swapped.sort(key=lambda r: r.arrival)\n", ""),
        "admits while requests are swapped out": ("A5.3", "        if not self.swapped:\n            self.admit(step)", "        self.admit(step)"),
        "swaps in during a step that preempted": ("A5.3", "    if not step.preempted:\n        self.resume_swapped(step)\n        if not self.swapped:\n            self.admit(step)",
                                                 "    self.resume_swapped(step)\n    if not step.preempted and not self.swapped:\n        self.admit(step)"),
        "swap-in ignores the watermark": ("A5.3", "room = self.manager.num_free_blocks - self.watermark_blocks\n        if self.blocks_for(len(req.tokens))",
                                          "room = self.manager.num_free_blocks\n        if self.blocks_for(len(req.tokens))"),
        "recomputed counts first prefills": ("A5.4", "recomputed += sum(len(r.tokens) for r in step.prefills if r.output)", "recomputed += sum(len(r.tokens) for r in step.prefills)"),
        "chunk takes blocks for the whole prompt": ("A5.5", "self.manager.allocate(req.rid, req.tokens[:start + n])", "self.manager.allocate(req.rid, req.tokens)"),
        "running chunks do not spend the budget": ("A5.5", "Chunk(req, start, n))\n            budget -= n\n        elif", "Chunk(req, start, n))\n        elif"),
        "a request over the budget waits for an empty step": ("A5.5", "        n = min(len(req.tokens) - start, budget)\n",
                                                               "        n = min(len(req.tokens) - start, budget)\n        if n < len(req.tokens) - start and step.chunks:\n            break\n"),
        "out of budget, dropped from running": ("A5.5", "            self.running.append(req)\n            continue", "            continue"),
        "chunked step preempts the earliest arrival": ("A5.5", "self.blocks_for(start)\n        while need > self.manager.num_free_blocks and queue:\n            self.preempt(queue.pop(), step)",
                                                       "self.blocks_for(start)\n        while need > self.manager.num_free_blocks and queue:\n            self.preempt(queue.popleft(), step)"),
        "admits after a preemption": ("A5.5", "while not step.preempted and self.waiting", "while self.waiting"),
        "prefix hit ignored": ("A5.5", "start, parked = cached_prefix(self.manager, req.tokens)", "start, parked = 0, 0"),
        "parked hits cost no free block": ("A5.5", "start // self.manager.block_size + parked", "start // self.manager.block_size"),
    },
    "A6": {
        "ties broken by the latest arrival": ("A6.1", "return len(group.prompt_token_ids), group.arrival", "return len(group.prompt_token_ids), -group.arrival"),
        "longest prompt first": ("A6.1", "return len(group.prompt_token_ids), group.arrival", "return -len(group.prompt_token_ids), group.arrival"),
        "sweep ignores the policy": ("A6.2", "config = PagedConfig(scheduler=SchedulerConfig(policy=policy, chunked_prefill=False))", "config = PagedConfig(scheduler=SchedulerConfig(chunked_prefill=False))"),
        "audit always reports preemption": ("A6.3", "\"preempted\": result.preemptions > 0,", "\"preempted\": True,"),
        "longest fifth, not tenth": ("A6.4", "np.quantile(prompt_lens, 0.9)", "np.quantile(prompt_lens, 0.8)"),
    },
    "A7": {
        "rollback keeps an emptied block": ("A7.2", "keep = -(-num_tokens // bs)\n", "keep = -(-num_tokens // bs) + (num_tokens < n)\n    keep = min(keep, len(table.blocks))\n"),
        "rollback releases head first": ("A7.2", "released = table.blocks[keep:][::-1]", "released = table.blocks[keep:]"),
        "rollback cuts a full verified block": ("A7.2", "low = max(1, table.num_verified // bs * bs)", "low = 1"),
        "rollback leaves the kept proposals unverified": ("A7.2", "    table.num_verified = num_tokens\n", ""),
        "caches a block holding a rejected token": ("A7.3", "return table.blocks[: table.num_verified // table.block_size]",
                                                    "return table.blocks[: len(table.token_ids) // table.block_size]"),
        "caches the partly filled block": ("A7.3", "return table.blocks[: table.num_verified // table.block_size]",
                                           "return table.blocks[: -(-table.num_verified // table.block_size)]"),
        "proposals counted as verified": ("A7.1", "table.num_verified = len(table.token_ids) - num_speculative", "table.num_verified = len(table.token_ids)"),
        "proposal writes into a shared block": ("A7.1", "shared = n % bs != 0 and pool.refcount(table.blocks[-1]) > 1", "shared = False"),
        "copy takes the first block handed out": ("A7.1", "copy = (table.blocks[-1], new.pop())", "copy = (table.blocks[-1], new.pop(0))"),
    },
}

CORRECT = {
    "A1": {
        "padded blocks, and prints": [
            ("    blocks = x.split(block_size, dim=-1)  # each [..., B]; the last may be shorter\n",
             "    print('block_stats of', tuple(x.shape))  # the student's own print: never graded\n"
             "    blocks = x.split(block_size, dim=-1)  # each [..., B]; the last may be shorter\n"),
            ("return torch.exp(x - m) / l  # [..., n]", "p = torch.exp(x - m)\n    return p / l"),
        ],
    },
    "A2": {
        "slices, sets and a debug print": [
            ("        blocks = [self.free_list.pop() for _ in range(n)]\n",
             "        blocks = self.free_list[len(self.free_list) - n :][::-1]\n"
             "        del self.free_list[len(self.free_list) - n :]\n"
             "        print('allocate', n, '->', blocks)  # a debug print: never graded\n"),
            ("    entries = Counter(b for table in tables for b in table.blocks)\n",
             "    entries = Counter()\n    for table in tables:\n        entries.update(table.blocks)\n"),
        ],
        "copy's block and new blocks in one allocate": [
            ("            src, (dst,) = self.blocks[-1], pool.allocate(1)\n            pool.release([src])  # the other sharers keep it\n            self.blocks[-1] = dst\n            copy = (src, dst)\n        super().append(n)\n        return copy",
             "            src, (dst, *new) = self.blocks[-1], pool.allocate(needed)\n            pool.release([src])\n            self.blocks[-1] = dst\n            self.blocks += new\n            self.num_tokens += n\n            return src, dst\n        super().append(n)\n        return copy"),
        ],
    },
    "A3": {
        "lookup by a while loop, and prints": [
            ("        bs, hits, parent = self.block_size, [], None\n        for i, key in enumerate(block_keys(token_ids, bs, self.key_fn)):\n            block = self.block_of.get(key)\n            if block is None:\n                break\n",
             "        bs, hits, parent = self.block_size, [], None\n        keys = block_keys(token_ids, bs, self.key_fn)\n        print('lookup', len(keys), 'keys')  # never graded\n        i = -1\n        while i + 1 < len(keys):\n            i += 1\n            key = keys[i]\n            block = self.block_of.get(key)\n            if block is None:\n                break\n"),
        ],
    },
    "A4": {
        "flat-index gather and a logsumexp merge": [
            ("    return cache[blocks, t % block_size]  # [seq_len, num_kv_heads, head_dim]",
             "    flat = cache.flatten(0, 1)  # [num_blocks * block_size, num_kv_heads, head_dim]\n    return flat[blocks * block_size + t % block_size]"),
            ("    lse_max = lse.amax(dim=-1, keepdim=True)  # [..., 1], finite: split 0 is never empty\n    w = torch.exp(lse - lse_max)  # [..., P]; an empty split (-inf) weighs 0\n    return (w[..., None] * parts).sum(dim=-2) / w.sum(dim=-1, keepdim=True)",
             "    w = torch.exp(lse - torch.logsumexp(lse, dim=-1, keepdim=True))  # [..., P], sums to 1\n    return (w[..., None] * parts).sum(dim=-2)"),
        ],
    },
    "A5": {
        "admission with a for loop, and prints": [
            ("    budget = self.max_num_batched_tokens - len(step.decodes)\n    while self.waiting:\n        req = self.waiting[0]\n",
             "    budget = self.max_num_batched_tokens - len(step.decodes)\n    for req in list(self.waiting):\n        print('considering', req.rid)  # never graded\n"),
        ],
        "chunked step: out of budget, the rest of the queue kept at once, and prints": [
            ("        if budget == 0:\n            self.running.append(req)\n            continue\n",
             "        if budget == 0:\n            print('out of budget at', req.rid)  # never graded\n            self.running += [req, *queue]\n            break\n"),
        ],
    },
    "A6": {
        "a percentile, and a loop in the audit": [
            ("long = prompt_lens > np.quantile(prompt_lens, 0.9)", "long = prompt_lens > np.percentile(prompt_lens, 90)"),
            ("\"full outputs\": all(lengths.get(r.id) == r.output_len for r in requests),",
             "\"full outputs\": min([lengths.get(r.id) == r.output_len for r in requests]),"),
        ],
    },
    "A7": {
        "released blocks gathered in a loop, full blocks by a comprehension, and prints": [
            ("    released = table.blocks[keep:][::-1]\n    table.pool.release(released)\n",
             "    released = []\n    for b in reversed(table.blocks[keep:]):\n        released.append(b)\n"
             "    print('releasing', released)  # never graded\n    table.pool.release(released)\n"),
            ("return table.blocks[: table.num_verified // table.block_size]",
             "full = [b for i, b in enumerate(table.blocks) if (i + 1) * table.block_size <= table.num_verified]\n    return full"),
        ],
    },
}

FORBIDDEN = {
    "A1": ("A1.3", "    return torch.exp(x - m.unsqueeze(-1)) / l.unsqueeze(-1)", "    return x.softmax(-1)"),
    "A2": ("A2.1", "        if n > len(self.free_list):\n            raise OutOfBlocks(n, len(self.free_list))\n        blocks = [self.free_list.pop() for _ in range(n)]",
           "        self.__dict__.setdefault('lib', BlockAllocator(self.num_blocks))\n        blocks = self.lib.allocate(n)"),
    "A3": ("A3.1", "return hash((parent_key, tuple(tokens)))", "return block_key(parent_key, tuple(tokens))"),
    "A4": ("A4.1a", "    return cache[blocks, t % block_size]  # [seq_len, num_kv_heads, head_dim]", "    return ref.gather_kv(cache, block_table, seq_len)"),
    "A5": ("A5.4", "    manager = KVCacheManager(num_gpu_blocks, block_size, num_cpu_blocks)\n",
           "    from pagedlab.engine import Scheduler  # forbidden: the reference\n    manager = KVCacheManager(num_gpu_blocks, block_size, num_cpu_blocks)\n"),
    "A7": ("A7.2", "    table.pool.release(released)\n", "    table.pool.release(released)\n    KVCacheManager(1, 1)  # forbidden: the reference\n"),
}
