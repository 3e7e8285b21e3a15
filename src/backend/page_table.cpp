#include "backend/page_table.h"

#include <cuda_runtime_api.h>

#include "api/check.h"
#include "kernels/backend/page_table.h"
#include "kernels/check/value_checks.h"
#include "speedmla/check.h"

namespace speedmla::detail {

namespace {

// Checks the engine's page table and the first `rows` pool indices and describes them.
kernels::PageTable describe(const ArgChecker& c, const TensorView& req_to_page,
                            const TensorView& req_pool_indices, int64_t rows, Device device) {
  c.defined(req_to_page, "req_to_page", 2);
  c.dtype(req_to_page, "req_to_page", {DType::kInt32});
  c.last_dim_contiguous(req_to_page, "req_to_page");
  c.same_device(req_to_page, "req_to_page", device);
  c.defined(req_pool_indices, "req_pool_indices", 1);
  c.dtype(req_pool_indices, "req_pool_indices", {DType::kInt32, DType::kInt64});
  c.same_device(req_pool_indices, "req_pool_indices", device);
  c.require(req_pool_indices.shape[0] >= rows, "req_pool_indices must hold at least ", rows,
            " entries, got shape ", detail::shape_of(req_pool_indices));
  return kernels::PageTable{
      .req_to_page = req_to_page.ptr<const int32_t>(),
      .row_stride = req_to_page.strides[0],
      .pool_size = req_to_page.shape[0],
      .width = req_to_page.shape[1],
      .req_pool_indices = req_pool_indices.data,
      .req_pool_indices_stride = req_pool_indices.strides[0],
      .req_pool_indices_int64 = req_pool_indices.dtype == DType::kInt64,
  };
}

// The check mode (speedmla/check.h): flags pool indices of the first `rows` rows out of range.
// With the device current.
void check_pool_indices(const char* caller, const kernels::PageTable& pages, int64_t rows, bool cuda,
                        Stream stream) {
  if (!device_checks_enabled()) return;
  if (!cuda) return kernels::check_pool_indices_on_host({pages, rows});
  kernels::run_check_pool_indices({pages, rows}, stream);
  check_cuda(cudaGetLastError(), caller, "the check mode's validation kernel launch");
}

}  // namespace

void build_block_table(const char* caller, const TensorView& req_to_page,
                       const TensorView& req_pool_indices, int64_t num_valid_rows,
                       const TensorView& block_table, Stream stream) {
  const ArgChecker c(caller);
  const kernels::BlockTableParams params{
      .pages = describe(c, req_to_page, req_pool_indices, num_valid_rows, block_table.device),
      .num_rows = block_table.shape[0],
      .num_valid_rows = num_valid_rows,
      .block_table = block_table.ptr<int32_t>(),
      .block_table_stride = block_table.strides[0],
      .block_table_width = block_table.shape[1],
  };
  DeviceGuard guard(block_table.device, caller);
  check_pool_indices(caller, params.pages, num_valid_rows, block_table.is_cuda(), stream);
  if (!block_table.is_cuda()) return kernels::build_block_table_on_host(params);
  kernels::run_build_block_table(params, stream);
  check_cuda(cudaGetLastError(), caller, "the block-table kernel launch");
}

void build_range_slots(const char* caller, const TensorView& req_to_page,
                       const TensorView& req_pool_indices, int64_t num_rows,
                       const TensorView& ranges, int64_t page_size, const TensorView& slots,
                       Stream stream) {
  const ArgChecker c(caller);
  const kernels::RangeSlotsParams params{
      .pages = describe(c, req_to_page, req_pool_indices, num_rows, slots.device),
      .ranges = ranges.ptr<const int64_t>(),
      .num_ranges = ranges.shape[0],
      .page_size = page_size,
      .slots = slots.ptr<int64_t>(),
  };
  DeviceGuard guard(slots.device, caller);
  check_pool_indices(caller, params.pages, num_rows, slots.is_cuda(), stream);
  if (!slots.is_cuda()) return kernels::range_slots_on_host(params);
  kernels::run_range_slots(params, stream);
  check_cuda(cudaGetLastError(), caller, "the slot-list kernel launch");
}

}  // namespace speedmla::detail
