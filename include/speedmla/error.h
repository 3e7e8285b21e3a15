// speedmla/error.h — the one exception type every entry point throws.
#pragma once

#include <stdexcept>
#include <string>

namespace speedmla {

// Thrown for every invalid argument, unsupported configuration and CUDA failure.
// what() names the function, the argument and what was expected, e.g.
//   "mla_decode: kv_cache.shape[2] must be 576 (512 latent + 64 rope), got 512".
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace speedmla
