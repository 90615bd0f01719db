"""Paged KV blocks on two tiers (a BlockPool each, with its own block size), with prefix caching within each tier.

Prefix caching: a full computed block is registered under a hash chained over every token before it; a hit also
compares token ids, so a collision never serves wrong KV. Freed blocks keep their registration until reused, least
recently freed first. Blocks a demotion frees are held until its copy has read them: those handed out meanwhile are
copied first (hand_out_held), the rest free once it lands (hold_until, reclaim).
"""
from collections import OrderedDict, deque
from dataclasses import dataclass

from offload_engine.engine.sequence import BlockLocation, Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # chained hash -> block id
        self.held: list[int] = []  # freed by a demotion whose copy is not queued yet: usable, copied first
        self.handed_out: list[int] = []
        self.landing: deque[tuple[object, list[int]]] = deque()  # (the copy's event, the blocks it still reads)
        self._landing_ids: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.held)

    @property
    def num_landing(self) -> int:
        return len(self._landing_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def take_free(self) -> int:
        if self.free:
            block_id, _ = self.free.popitem(last=False)
        else:  # a held block: its KV crosses first (hand_out_held)
            block_id = self.held.pop()
            self.handed_out.append(block_id)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def share(self, block_id: int) -> None:
        self.blocks[block_id].ref_count += 1
        self.free.pop(block_id, None)
        if self.held and block_id in self.held:
            self.held.remove(block_id)  # in use again: it must not be handed out (its copy only reads it)

    def release(self, block_id: int, hold: bool = False) -> None:
        """One user fewer; at none the block is free again, or with hold, held for a demotion's copy."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if hold:
                self.held.append(block_id)
            elif block_id not in self._landing_ids:  # (a landing block revived by a prefix hit: free once landed)
                self.free[block_id] = None

    def hand_out_held(self, spare: int) -> list[int]:
        """The held blocks taken since they were held, and up to `spare` more put on the free list now (the
        next steps' room while the rest cross): all of these must be copied before the device writes any."""
        first, self.handed_out = self.handed_out, []
        for _ in range(min(spare, len(self.held))):
            block_id = self.held.pop()
            self.free[block_id] = None
            first.append(block_id)
        return first

    def hold_until(self, landed) -> None:
        """The held blocks return to the free list once `landed` (a CUDA event) has completed; at once if None."""
        held, self.held = self.held, []
        if landed is None:
            self.free.update(dict.fromkeys(held))
        elif held:
            self.landing.append((landed, held))
            self._landing_ids.update(held)

    def reclaim(self, wait: bool = False) -> None:
        """Frees the blocks whose copies have landed; with wait, first waits for all of them."""
        while self.landing and (wait or self.landing[0][0].query()):
            landed, blocks = self.landing.popleft()
            landed.synchronize()
            for block_id in blocks:
                self._landing_ids.discard(block_id)
                if self.blocks[block_id].ref_count == 0:
                    self.free[block_id] = None

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        block = self.blocks[block_id]
        block.hash, block.token_ids = block_hash, token_ids
        self.cached.setdefault(block_hash, block_id)


@dataclass
class DevicePartGrowth:
    """A split sequence's device part taking over the first blocks of its host part (or all of them, when it is
    promoted), shaped as a promotion move
    (kv_promotion copies `num_computed_tokens` tokens into `block_table`); `in_flight` is the sequence's."""

    seq: Sequence
    num_computed_tokens: int
    block_table: list[int]

    @property
    def in_flight(self) -> bool:
        return self.seq.in_flight

    @in_flight.setter
    def in_flight(self, value: bool) -> None:
        self.seq.in_flight = value


class BlockManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int, cpu_block_size: int,
                 enable_prefix_caching: bool = True):
        self.pools = {
            BlockLocation.GPU: BlockPool(num_gpu_blocks, block_size, enable_prefix_caching),
            BlockLocation.CPU: BlockPool(num_cpu_blocks, cpu_block_size, enable_prefix_caching),
        }
        self.num_prefix_hit_tokens = 0  # prompt tokens served from cached blocks instead of computed

    def reset(self) -> None:
        self.pools = {tier: BlockPool(p.num_blocks, p.block_size, p.enable_prefix_caching)
                      for tier, p in self.pools.items()}

    def pool(self, location: BlockLocation) -> BlockPool:
        return self.pools[location]

    def can_allocate(self, seq: Sequence, location: BlockLocation, device_tokens: int = 0) -> bool:
        """Room for the sequence's tokens now; with device_tokens, for a split with that many on the device."""
        if device_tokens:
            gpu, cpu = self.pools[BlockLocation.GPU], self.pools[BlockLocation.CPU]
            return (gpu.blocks_for(device_tokens) <= gpu.num_free
                    and cpu.blocks_for(len(seq) - device_tokens) <= cpu.num_free)
        pool = self.pools[location]
        return pool.blocks_for(len(seq)) <= pool.num_free

    def allocate(self, seq: Sequence, location: BlockLocation, device_tokens: int = 0) -> None:
        """Gives the sequence blocks for all its tokens, reusing cached prefix blocks where they match. With
        device_tokens (whole device blocks, host tier only) it is split, and prefix reuse covers the device part."""
        seq.location = seq.admitted_to = location
        if device_tokens:
            assert location == BlockLocation.CPU and device_tokens % self.pools[BlockLocation.GPU].block_size == 0
            gpu = self.pools[BlockLocation.GPU]
            seq.device_prefix, hits = self._take_blocks(gpu, seq, gpu.blocks_for(device_tokens))
            seq.num_device_tokens = seq.admitted_device_tokens = device_tokens
            host = self.pools[BlockLocation.CPU]
            seq.block_table = [host.take_free() for _ in range(host.blocks_for(len(seq) - device_tokens))]
            block_size = gpu.block_size
        else:
            pool = self.pools[location]
            seq.block_table, hits = self._take_blocks(pool, seq, pool.blocks_for(len(seq)))
            block_size = pool.block_size
        seq.num_hashed_blocks = hits
        seq.num_computed_tokens = hits * block_size
        self.num_prefix_hit_tokens += seq.num_computed_tokens

    @staticmethod
    def _take_blocks(pool: BlockPool, seq: Sequence, count: int) -> tuple[list[int], int]:
        """`count` blocks for the sequence's leading tokens, cached ones while they match: (table, hits)."""
        # Only blocks wholly before the last token may hit: that token must be computed to give logits. A request
        # for prompt_logprobs computes every token (a hit would skip their logits).
        wants_every_logit = seq.params.prompt_logprobs is not None
        reusable = (len(seq) - 1) // pool.block_size if pool.enable_prefix_caching and not wants_every_logit else 0
        table, hits, prefix_hash = [], 0, None
        for i in range(count):
            block_id = None
            if i == hits and i < reusable:  # every block so far was a hit: keep matching
                tokens = tuple(seq.token_ids[i * pool.block_size : (i + 1) * pool.block_size])
                prefix_hash = hash((prefix_hash, tokens))
                block_id = pool.lookup(prefix_hash, tokens)
            if block_id is None:
                table.append(pool.take_free())
            else:
                pool.share(block_id)
                table.append(block_id)
                hits += 1
        return table, hits

    def deallocate(self, seq: Sequence) -> None:
        pool = self.pools[seq.location]
        for block_id in reversed(seq.block_table):
            pool.release(block_id)
        gpu = self.pools[BlockLocation.GPU]
        for block_id in reversed(seq.device_prefix):
            gpu.release(block_id)
        seq.block_table, seq.device_prefix, seq.location = [], [], None
        seq.num_computed_tokens = seq.num_hashed_blocks = seq.num_device_tokens = 0

    def move(self, seq: Sequence, location: BlockLocation, hold: bool = False) -> list[int]:
        """Re-homes an unsplit sequence's computed KV on another tier (with hold, the old blocks are held for the
        copy). Returns the old block table: the caller copies it before anything else is scheduled."""
        assert not seq.is_split, "split sequences keep their parts (placement.promotions passes them over)"
        old_pool, new_pool = self.pools[seq.location], self.pools[location]
        old_table = seq.block_table
        for block_id in reversed(old_table):
            old_pool.release(block_id, hold)  # a registered block stays findable for prefix reuse on the old tier
        seq.block_table = [new_pool.take_free() for _ in range(new_pool.blocks_for(seq.num_computed_tokens))]
        seq.location, seq.num_hashed_blocks = location, 0
        self.register_computed_blocks(seq)
        return old_table

    def grow_device_part(self, seq: Sequence, num_host_blocks: int) -> tuple[DevicePartGrowth, list[int]]:
        """Moves the first num_host_blocks (computed, full) of a host-tier sequence's host part to the end of its
        device part; a whole host row becomes a split one. Returns the move and the old host blocks: the caller copies
        them before anything else is scheduled."""
        gpu, cpu = self.pools[BlockLocation.GPU], self.pools[BlockLocation.CPU]
        tokens = num_host_blocks * cpu.block_size
        assert seq.location == BlockLocation.CPU and tokens <= seq.num_computed_tokens - seq.num_device_tokens
        if not seq.is_split:
            seq.num_hashed_blocks = 0  # it counted host blocks; a split row registers its device part's
        old = seq.block_table[:num_host_blocks]
        for block_id in reversed(old):
            cpu.release(block_id)
        new = [gpu.take_free() for _ in range(gpu.blocks_for(tokens))]
        seq.device_prefix = seq.device_prefix + new
        seq.block_table = seq.block_table[num_host_blocks:]
        seq.num_device_tokens += tokens
        self.register_computed_blocks(seq)
        return DevicePartGrowth(seq, tokens, new), old

    def promote_split(self, seq: Sequence) -> tuple[DevicePartGrowth, list[int]]:
        """Moves a split sequence's whole host part (its computed tokens) after its device part: it becomes a device
        row. Returns the move and the old host blocks: the caller copies them before anything else is scheduled."""
        gpu, cpu = self.pools[BlockLocation.GPU], self.pools[BlockLocation.CPU]
        assert seq.is_split and seq.location == BlockLocation.CPU
        tokens = seq.num_computed_tokens - seq.num_device_tokens
        old = seq.block_table
        for block_id in reversed(old):
            cpu.release(block_id)
        new = [gpu.take_free() for _ in range(gpu.blocks_for(tokens))]
        seq.block_table, seq.device_prefix = seq.device_prefix + new, []
        seq.num_device_tokens, seq.location = 0, BlockLocation.GPU
        self.register_computed_blocks(seq)  # on from the device part's blocks, registered already
        return DevicePartGrowth(seq, tokens, new), old

    def settle(self, location: BlockLocation) -> bool:
        """Waits for the demotion copies still reading this tier's freed blocks, if any: whether there were."""
        pool = self.pools[location]
        if not pool.num_landing:
            return False
        pool.reclaim(wait=True)
        return True

    def can_append(self, seq: Sequence) -> bool:
        """Room for the newest token: a new block is needed only when it starts one."""
        pool = self.pools[seq.location]
        return pool.blocks_for(seq.num_host_tokens) <= len(seq.block_table) or pool.num_free >= 1

    def append_slot(self, seq: Sequence) -> None:
        pool = self.pools[seq.location]
        if pool.blocks_for(seq.num_host_tokens) > len(seq.block_table):
            seq.block_table.append(pool.take_free())

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Registers the sequence's newly full, computed blocks for prefix reuse. Of a split sequence, only the
        device part's: its host blocks do not start at token 0, where every lookup starts."""
        if seq.is_split:
            pool, table, computed = self.pools[BlockLocation.GPU], seq.device_prefix, min(seq.num_computed_tokens,
                                                                                          seq.num_device_tokens)
        else:
            pool, table, computed = self.pools[seq.location], seq.block_table, seq.num_computed_tokens
        if not pool.enable_prefix_caching:
            return
        size = pool.block_size
        prefix_hash = pool.blocks[table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else None
        for i in range(seq.num_hashed_blocks, computed // size):
            tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
            prefix_hash = hash((prefix_hash, tokens))
            pool.register(table[i], prefix_hash, tokens)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, computed // size)
