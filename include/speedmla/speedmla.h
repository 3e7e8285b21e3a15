// speedmla/speedmla.h — the whole public API.
#pragma once

#include "speedmla/cache.h"
#include "speedmla/check.h"
#include "speedmla/decode.h"
#include "speedmla/error.h"
#include "speedmla/merge.h"
#include "speedmla/numeric.h"
#include "speedmla/prefill.h"
#include "speedmla/quantize.h"
#include "speedmla/tensor.h"
