from offload_engine.engine.graphs.cuda_graphs import batch_buckets


def test_every_batch_size_has_the_smallest_bucket_that_holds_it():
    for max_num_seqs in (1, 3, 8, 16, 50, 256):
        buckets = batch_buckets(max_num_seqs)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_num_seqs
        for batch in range(1, max_num_seqs + 1):
            chosen = next(b for b in buckets if b >= batch)
            assert chosen - batch < 16 and (batch > 8 or chosen < 2 * batch)
