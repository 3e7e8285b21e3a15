// The memory system's read bandwidth for cache rows gathered in runs of consecutive rows, each
// run somewhere at random in a large pool (read_floor.cu): the floor under a decode kernel's
// time at small page sizes, where a page's rows are all that sit together.
#pragma once

#include <cstdint>
#include <vector>

namespace speedmla::bench {

// Reads every row at `row_offsets` (bytes into `pool`, 16-byte aligned) of `row_bytes` (a
// multiple of 16) with as many loads in flight as the GPU holds; returns the median of `iters`
// timed reads in ms, the L2 flushed (`flush`, `flush_bytes`) before each.
double time_row_reads(const void* pool, const std::vector<int64_t>& row_offsets, int row_bytes, void* flush,
                      size_t flush_bytes, int iters);

}  // namespace speedmla::bench
