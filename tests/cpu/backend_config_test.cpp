// MlaBackend construction: every rejected configuration names its field; valid ones build.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "speedmla/backend.h"
#include "speedmla/error.h"

namespace speedmla::test {
namespace {

MlaBackendConfig valid_config() {
  MlaBackendConfig config;
  config.num_heads = 128;
  config.tp_size = 8;
  config.page_size = 64;
  config.kv_cache_dtype = DType::kFloat8E4M3;
  config.context_len = 4096;
  config.max_batch = 8;
  config.max_graph_batch = 4;
  return config;
}

// Expects construction to throw an Error whose message contains `needle`.
void expect_rejected(const std::function<void(MlaBackendConfig&)>& edit, const std::string& needle) {
  MlaBackendConfig config = valid_config();
  edit(config);
  try {
    MlaBackend backend(config);
    ADD_FAILURE() << "accepted a config that should fail with \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message \"" << e.what() << "\" lacks \"" << needle << "\"";
  }
}

TEST(BackendConfig, AcceptsValidConfigs) {
  for (int64_t page : {1, 2, 4, 8, 16, 32, 64, 128})
    for (DType dtype : {DType::kFloat8E4M3, DType::kBFloat16}) {
      MlaBackendConfig config = valid_config();
      config.page_size = page;
      config.kv_cache_dtype = dtype;
      MlaBackend backend(config);
      EXPECT_EQ(backend.config().num_local_heads(), 16);
      EXPECT_EQ(backend.block_table_width(), padded_block_table_width(4096, page));
    }
  MlaBackendConfig seed = valid_config();
  seed.seed_compatible = true;
  seed.page_size = 32;
  EXPECT_NO_THROW(MlaBackend{seed});
  MlaBackendConfig single_head = valid_config();
  single_head.num_heads = 1;
  single_head.tp_size = 1;
  EXPECT_NO_THROW(MlaBackend{single_head});
}

TEST(BackendConfig, RejectsHeadCounts) {
  expect_rejected([](auto& c) { c.num_heads = 0; }, "config.num_heads must be >= 1");
  expect_rejected([](auto& c) { c.tp_size = 0; }, "config.tp_size must be >= 1");
  expect_rejected([](auto& c) { c.num_heads = 100; c.tp_size = 8; }, "must be a multiple of config.tp_size");
  expect_rejected([](auto& c) { c.num_heads = 256; c.tp_size = 1; }, "heads per rank num_heads / tp_size must be <= 128");
}

TEST(BackendConfig, RejectsPageSizes) {
  for (int64_t page : {0, 3, 48, 256})
    expect_rejected([page](auto& c) { c.page_size = page; }, "config.page_size must be one the decode kernels support");
}

TEST(BackendConfig, RejectsCacheDtypes) {
  for (DType dtype : {DType::kFloat16, DType::kFloat32, DType::kInt32})
    expect_rejected([dtype](auto& c) { c.kv_cache_dtype = dtype; }, "config.kv_cache_dtype must be float8_e4m3fn or bfloat16");
}

TEST(BackendConfig, SeedCompatibleModeKeepsTheSeedsRules) {
  for (int64_t page : {8, 16, 128})
    expect_rejected([page](auto& c) { c.seed_compatible = true; c.page_size = page; },
                    "config.seed_compatible requires page_size 32 or 64");
  expect_rejected([](auto& c) { c.seed_compatible = true; c.kv_cache_dtype = DType::kBFloat16; },
                  "config.seed_compatible requires a float8_e4m3fn KV cache");
}

TEST(BackendConfig, RejectsSizes) {
  expect_rejected([](auto& c) { c.context_len = 0; }, "config.context_len must be in [1, 2^31 - 1]");
  expect_rejected([](auto& c) { c.context_len = int64_t{1} << 31; }, "config.context_len must be in [1, 2^31 - 1]");
  expect_rejected([](auto& c) { c.max_batch = 0; }, "config.max_batch must be >= 1");
  expect_rejected([](auto& c) { c.max_graph_batch = -1; }, "config.max_graph_batch must be >= 0");
  expect_rejected([](auto& c) { c.num_draft_tokens = -1; }, "config.num_draft_tokens must be >= 0");
  expect_rejected([](auto& c) { c.chunked_prefill_capacity = 0; }, "config.chunked_prefill_capacity must be in");
}

TEST(BackendConfig, RejectsMissingCudaDevice) {
  expect_rejected([](auto& c) { c.device = Device{DeviceKind::kCUDA, 1000}; }, "does not exist");
}

TEST(BackendConfig, DecodeQueryLength) {
  MlaBackendConfig config = valid_config();
  EXPECT_EQ(config.decode_q_len(), 1);
  config.num_draft_tokens = 1;
  EXPECT_EQ(config.decode_q_len(), 1);
  config.num_draft_tokens = 4;
  EXPECT_EQ(config.decode_q_len(), 4);
}

TEST(BackendConfig, PaddedBlockTableWidth) {
  // ceil(context / page) rounded up to a multiple of max(1, 128 / page).
  EXPECT_EQ(padded_block_table_width(1, 64), 2);
  EXPECT_EQ(padded_block_table_width(128, 64), 2);
  EXPECT_EQ(padded_block_table_width(129, 64), 4);
  EXPECT_EQ(padded_block_table_width(4096, 32), 128);
  EXPECT_EQ(padded_block_table_width(4097, 32), 132);
  EXPECT_EQ(padded_block_table_width(1, 128), 1);
  EXPECT_EQ(padded_block_table_width(300, 128), 3);
  EXPECT_EQ(padded_block_table_width(100, 8), 16);
  EXPECT_THROW(padded_block_table_width(0, 64), Error);
  EXPECT_THROW(padded_block_table_width(64, 0), Error);
}

}  // namespace
}  // namespace speedmla::test
