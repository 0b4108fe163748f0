// An output buffer that nothing writes, for XLA:CPU through jax.ffi (pallas_kernels/alloc/cpu.py).
//
// Why it exists: the KV pool must be allocated at full size up front (its shape is static
// in every compiled step), but a pool filled with jnp.zeros is resident from the first
// second: 1 GiB of the default server's footprint before any request. XLA:CPU takes a large
// output buffer from malloc, which maps fresh zero pages for it; this handler returns
// without touching them, so a page of the pool becomes resident only when a step first
// writes KV into it. The content is unspecified (zeros, or whatever a reused heap block
// held): the paged cache never reads a slot it has not written (jaxinfer/engine/kv_cache.py).
#include "ffi_lite.h"

// Nothing to decode but the count: one result, written by nobody.
JAXINFER_FFI_HANDLER(JaxinferUninitialized, f) {
  if (!f.ok(0, 1)) return f.error();
  return jaxinfer_ffi::Error::Success();
}
