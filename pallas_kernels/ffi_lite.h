// The slice of XLA's FFI that the C++ CPU kernels use, on the plain C API (c_api.h) alone.
//
// Why not xla/ffi/api/ffi.h: that header's generic binding machinery (and the <iostream>,
// <variant>, <string> ... it pulls in) is ~2.5 s of parsing and ~1.5 s of code generation
// per kernel file, most of the ~25 CPU seconds the four kernels took to build on a fresh
// machine, where they compete with loading the model for two cores (benchmarks/RESULTS.md,
// "Start-up").
// What the kernels need is small: typed buffers, a variable tail of buffers, scalar
// attributes, XLA's intra-op thread pool and an error. The types below mirror the names of
// ffi.h's (Buffer<F32>, ResultBuffer, AnyBuffer, RemainingArgs, ThreadPool, Error) so the
// kernel bodies read the same; a handler decodes its call frame explicitly:
//
//   JAXINFER_FFI_HANDLER(JaxinferF32Matmul, f) {
//     auto x = f.arg<ffi::F32>(0); auto w = f.arg<ffi::F32>(1); auto y = f.ret<ffi::F32>(0);
//     if (!f.ok(/*args=*/2, /*rets=*/1)) return f.error();
//     return F32MatmulImpl(f.pool(), x, w, y);
//   }
//
// As ffi.h does, a handler answers XLA's metadata query (API version, no traits, no state),
// refuses any stage but execute, and reports a wrong count or type of operand as an error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>

#include "xla/ffi/api/c_api.h"

namespace jaxinfer_ffi {

enum class DataType : int {
  S8 = XLA_FFI_DataType_S8,
  S32 = XLA_FFI_DataType_S32,
  F32 = XLA_FFI_DataType_F32,
  F16 = XLA_FFI_DataType_F16,
};
constexpr DataType S8 = DataType::S8, S32 = DataType::S32, F32 = DataType::F32, F16 = DataType::F16;

template <DataType> struct Native;
template <> struct Native<DataType::S8> { using type = int8_t; };
template <> struct Native<DataType::S32> { using type = int32_t; };
template <> struct Native<DataType::F32> { using type = float; };
template <> struct Native<DataType::F16> { using type = uint16_t; };   // IEEE half bits

// A buffer's dimensions: a read-only view of XLA's int64 array.
class Dims {
 public:
  Dims(const int64_t* p, int64_t n) : p_(p), n_(static_cast<size_t>(n)) {}
  size_t size() const { return n_; }
  int64_t operator[](size_t i) const { return p_[i]; }
  int64_t back() const { return p_[n_ - 1]; }
  const int64_t* begin() const { return p_; }
  const int64_t* end() const { return p_ + n_; }

 private:
  const int64_t* p_;
  size_t n_;
};

class AnyBuffer {
 public:
  explicit AnyBuffer(const XLA_FFI_Buffer* b = nullptr) : b_(b) {}
  DataType element_type() const { return static_cast<DataType>(b_->dtype); }
  void* untyped_data() const { return b_->data; }
  Dims dimensions() const { return Dims(b_->dims, b_->rank); }
  size_t element_count() const {
    size_t n = 1;
    for (int64_t i = 0; i < b_->rank; ++i) n *= static_cast<size_t>(b_->dims[i]);
    return n;
  }

 protected:
  const XLA_FFI_Buffer* b_;
};

template <DataType T>
class Buffer : public AnyBuffer {
 public:
  using AnyBuffer::AnyBuffer;
  typename Native<T>::type* typed_data() const {
    return static_cast<typename Native<T>::type*>(b_->data);
  }
};

// A result buffer, used through -> as ffi.h's Result<Buffer<T>> is.
template <DataType T>
class ResultBuffer {
 public:
  explicit ResultBuffer(const XLA_FFI_Buffer* b = nullptr) : buf_(b) {}
  const Buffer<T>* operator->() const { return &buf_; }

 private:
  Buffer<T> buf_;
};

// Bytes of one element of the dtypes the kernels take (0: another dtype).
inline size_t element_bytes(XLA_FFI_DataType t) {
  switch (t) {
    case XLA_FFI_DataType_S8: case XLA_FFI_DataType_U8: case XLA_FFI_DataType_PRED: return 1;
    case XLA_FFI_DataType_F16: return 2;
    case XLA_FFI_DataType_S32: case XLA_FFI_DataType_F32: return 4;
    default: return 0;
  }
}

// The operands from some position on (every layer's weights or pages).
class RemainingArgs {
 public:
  RemainingArgs(const XLA_FFI_Args* args, int64_t from) : a_(args), from_(from) {}
  size_t size() const { return static_cast<size_t>(a_->size - from_); }
  // The i-th remaining operand as B (Buffer<T> or AnyBuffer); none if it is not a buffer
  // of that type.
  template <class B>
  std::optional<B> get(size_t i) const { return decode<B>(a_->types, a_->args, a_->size, from_ + i); }

  // Layer l's buffer of group `kind` when these operands are `kinds` groups, each every
  // layer's buffers of one kind (the layer loop: jaxinfer/models/layer_loop.py): with L >= 2
  // operands a group (each layer's buffer its own operand) the group's l-th; with one a
  // group (every layer's buffer stacked [L, ...]) row l of it, described in `view` (a
  // pointer into the stack: nothing copied; `view` must outlive the result). None when the
  // operand is not a buffer of type B or l is not one of its layers.
  template <class B>
  std::optional<B> layer(size_t kind, size_t kinds, int64_t l, XLA_FFI_Buffer& view) const {
    return layer_of<B>(a_->types, a_->args, a_->size, from_, kind, kinds, l, view);
  }

  // These operands from `k` more on (a kernel's groups after some leading operands).
  RemainingArgs skip(size_t k) const { return RemainingArgs(a_, from_ + static_cast<int64_t>(k)); }

  // `layer` over items [from, n) of an argument or result list (both sides use it: the
  // in-place KV write reads a stacked result the same way as its operand).
  template <class B>
  static std::optional<B> layer_of(const void* types, void* const* items, int64_t n, int64_t from,
                                   size_t kind, size_t kinds, int64_t l, XLA_FFI_Buffer& view) {
    const size_t size = static_cast<size_t>(n - from);
    if (kinds == 0 || size == 0 || size % kinds || kind >= kinds || l < 0) return std::nullopt;
    const size_t per = size / kinds;
    if (per > 1) return l < static_cast<int64_t>(per) ? decode<B>(types, items, n, from + kind * per + l) : std::nullopt;
    const int64_t i = from + static_cast<int64_t>(kind);
    if (static_cast<const int*>(types)[i] != XLA_FFI_ArgType_BUFFER) return std::nullopt;
    const auto* b = static_cast<const XLA_FFI_Buffer*>(items[i]);
    size_t row = element_bytes(b->dtype);
    if (b->rank < 1 || l >= b->dims[0] || row == 0 || !accepts<B>(b)) return std::nullopt;
    for (int64_t r = 1; r < b->rank; ++r) row *= static_cast<size_t>(b->dims[r]);
    view = *b;
    view.data = static_cast<char*>(b->data) + static_cast<size_t>(l) * row;
    view.rank = b->rank - 1;
    view.dims = b->dims + 1;
    return B(&view);
  }

  template <class B>
  static std::optional<B> decode(const void* types, void* const* items, int64_t n, int64_t i) {
    if (i < 0 || i >= n || static_cast<const int*>(types)[i] != XLA_FFI_ArgType_BUFFER) return std::nullopt;
    const auto* b = static_cast<const XLA_FFI_Buffer*>(items[i]);
    if (!accepts<B>(b)) return std::nullopt;
    return B(b);
  }

 private:
  template <class B>
  static bool accepts(const XLA_FFI_Buffer* b);
  const XLA_FFI_Args* a_;
  int64_t from_;
};

template <class B>
struct BufferDtype { static constexpr int value = -1; };        // AnyBuffer: any dtype
template <DataType T>
struct BufferDtype<Buffer<T>> { static constexpr int value = static_cast<int>(T); };

template <class B>
bool RemainingArgs::accepts(const XLA_FFI_Buffer* b) {
  return BufferDtype<B>::value < 0 || b->dtype == static_cast<XLA_FFI_DataType>(BufferDtype<B>::value);
}

// The results from some position on (the in-place KV write's aliased pages).
class RemainingRets {
 public:
  RemainingRets(const XLA_FFI_Rets* rets, int64_t from) : r_(rets), from_(from) {}
  size_t size() const { return static_cast<size_t>(r_->size - from_); }
  template <class B>
  std::optional<B> get(size_t i) const {
    return RemainingArgs::decode<B>(r_->types, r_->rets, r_->size, from_ + static_cast<int64_t>(i));
  }
  // RemainingArgs::layer for results (the layer loop's in-place writes).
  template <class B>
  std::optional<B> layer(size_t kind, size_t kinds, int64_t l, XLA_FFI_Buffer& view) const {
    return RemainingArgs::layer_of<B>(r_->types, r_->rets, r_->size, from_, kind, kinds, l, view);
  }

 private:
  const XLA_FFI_Rets* r_;
  int64_t from_;
};

class Error {
 public:
  static Error Success() { return Error(XLA_FFI_Error_Code_OK, ""); }
  static Error InvalidArgument(const char* msg) { return Error(XLA_FFI_Error_Code_INVALID_ARGUMENT, msg); }
  static Error Internal(const char* msg) { return Error(XLA_FFI_Error_Code_INTERNAL, msg); }
  bool success() const { return code_ == XLA_FFI_Error_Code_OK; }
  XLA_FFI_Error_Code code() const { return code_; }
  const char* message() const { return msg_; }

 private:
  Error(XLA_FFI_Error_Code code, const char* msg) : code_(code), msg_(msg) {}
  XLA_FFI_Error_Code code_;
  const char* msg_;          // the kernels' messages are string literals
};

// XLA's intra-op thread pool (XLA:CPU's Eigen pool) for this call.
class ThreadPool {
 public:
  ThreadPool(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx) : api_(api), ctx_(ctx) {}

  // Runs f() on a pool thread, or here if the pool refuses the task (as ffi.h does).
  template <typename F>
  void Schedule(F&& f) {
    XLA_FFI_Task* task = +[](void* data) {
      auto* fn = static_cast<F*>(data);
      (*fn)();
      delete fn;
    };
    F* data = new F(static_cast<F&&>(f));
    XLA_FFI_ThreadPool_Schedule_Args args;
    args.struct_size = XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.ctx = ctx_;
    args.task = task;
    args.data = data;
    if (XLA_FFI_Error* err = api_->XLA_FFI_ThreadPool_Schedule(&args)) {
      destroy(err);
      task(data);
    }
  }

  int64_t num_threads() const {
    int64_t n = 0;
    XLA_FFI_ThreadPool_NumThreads_Args args;
    args.struct_size = XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.ctx = ctx_;
    args.num_threads = &n;
    if (XLA_FFI_Error* err = api_->XLA_FFI_ThreadPool_NumThreads(&args)) destroy(err);
    return n;
  }

 private:
  void destroy(XLA_FFI_Error* err) const {
    XLA_FFI_Error_Destroy_Args args;
    args.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.error = err;
    api_->XLA_FFI_Error_Destroy(&args);
  }
  const XLA_FFI_Api* api_;
  XLA_FFI_ExecutionContext* ctx_;
};

// One call's operands, results and attributes. Decoding never throws: a missing or
// mistyped operand yields an empty buffer and marks the frame failed, which the handler
// checks (ok) before it runs the kernel.
class Frame {
 public:
  explicit Frame(XLA_FFI_CallFrame* cf) : cf_(cf) {}

  template <DataType T>
  Buffer<T> arg(int64_t i) { return typed<Buffer<T>>(RemainingArgs::decode<Buffer<T>>(
      cf_->args.types, cf_->args.args, cf_->args.size, i), "an operand is missing or of the wrong type"); }
  AnyBuffer any_arg(int64_t i) { return typed<AnyBuffer>(RemainingArgs::decode<AnyBuffer>(
      cf_->args.types, cf_->args.args, cf_->args.size, i), "an operand is missing or not a buffer"); }
  template <DataType T>
  ResultBuffer<T> ret(int64_t i) {
    auto b = RemainingArgs::decode<Buffer<T>>(cf_->rets.types, cf_->rets.rets, cf_->rets.size, i);
    if (!b) fail("a result is missing or of the wrong type");
    return ResultBuffer<T>(b ? raw_ret(i) : nullptr);
  }
  RemainingArgs args_from(int64_t i) { return RemainingArgs(&cf_->args, i); }
  RemainingRets rets_from(int64_t i) { return RemainingRets(&cf_->rets, i); }
  ThreadPool pool() const { return ThreadPool(cf_->api, cf_->ctx); }

  // A scalar attribute of XLA type `dtype` (S64 for int64_t, F32 for float) by name.
  template <typename V>
  V attr(const char* name, XLA_FFI_DataType dtype) {
    const XLA_FFI_Attrs& a = cf_->attrs;
    const size_t len = std::strlen(name);
    for (int64_t i = 0; i < a.size; ++i) {
      const XLA_FFI_ByteSpan* n = a.names[i];
      if (n->len != len || std::memcmp(n->ptr, name, len) != 0) continue;
      const auto* s = static_cast<const XLA_FFI_Scalar*>(a.attrs[i]);
      if (a.types[i] != XLA_FFI_AttrType_SCALAR || s->dtype != dtype) break;
      V v;
      std::memcpy(&v, s->value, sizeof(V));
      return v;
    }
    fail("an attribute is missing or of the wrong type");
    return V();
  }
  int64_t attr_i64(const char* name) { return attr<int64_t>(name, XLA_FFI_DataType_S64); }
  float attr_f32(const char* name) { return attr<float>(name, XLA_FFI_DataType_F32); }

  // Every operand decoded and the counts right: exactly `args` / `rets`, or at least
  // that many where a Remaining* tail follows (`more_args` / `more_rets`).
  bool ok(int64_t args, int64_t rets, bool more_args = false, bool more_rets = false) {
    if (more_args ? cf_->args.size < args : cf_->args.size != args) fail("wrong number of operands");
    if (more_rets ? cf_->rets.size < rets : cf_->rets.size != rets) fail("wrong number of results");
    return error_ == nullptr;
  }
  Error error() const { return Error::InvalidArgument(error_ ? error_ : "bad call"); }

 private:
  template <class B>
  B typed(const std::optional<B>& b, const char* why) {
    if (!b) fail(why);
    return b ? *b : B();
  }
  const XLA_FFI_Buffer* raw_ret(int64_t i) const { return static_cast<const XLA_FFI_Buffer*>(cf_->rets.rets[i]); }
  void fail(const char* why) {
    if (!error_) error_ = why;
  }
  XLA_FFI_CallFrame* cf_;
  const char* error_ = nullptr;
};

// The C entry point XLA calls: checks the frame, answers the metadata query, runs body.
template <Error (*Body)(Frame&)>
XLA_FFI_Error* Call(XLA_FFI_CallFrame* cf) {
  const XLA_FFI_Api* api = cf->api;
  auto make_error = [api](XLA_FFI_Error_Code code, const char* msg) {
    XLA_FFI_Error_Create_Args args;
    args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.message = msg;
    args.errc = code;
    return api->XLA_FFI_Error_Create(&args);
  };
  if (cf->struct_size != XLA_FFI_CallFrame_STRUCT_SIZE)
    return make_error(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                      "unexpected XLA_FFI_CallFrame size: rebuild the kernel against this jaxlib");
  if (cf->extension_start != nullptr && cf->extension_start->type == XLA_FFI_Extension_Metadata) {
    auto* ext = reinterpret_cast<XLA_FFI_Metadata_Extension*>(cf->extension_start);
    if (ext->extension_base.struct_size < XLA_FFI_Metadata_Extension_STRUCT_SIZE ||
        ext->metadata->struct_size < XLA_FFI_Metadata_STRUCT_SIZE)
      return make_error(XLA_FFI_Error_Code_INVALID_ARGUMENT, "unexpected XLA_FFI_Metadata size");
    ext->metadata->api_version = XLA_FFI_Api_Version{XLA_FFI_Api_Version_STRUCT_SIZE, nullptr,
                                                     XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
    ext->metadata->traits = 0;
    ext->metadata->state_type_id = XLA_FFI_UNKNOWN_TYPE_ID;
    return nullptr;
  }
  if (cf->stage != XLA_FFI_ExecutionStage_EXECUTE)
    return make_error(XLA_FFI_Error_Code_INVALID_ARGUMENT, "wrong execution stage: expected execute");
  Frame frame(cf);
  const Error e = Body(frame);
  return e.success() ? nullptr : make_error(e.code(), e.message());
}

}  // namespace jaxinfer_ffi

// Defines the exported handler `symbol`, whose body decodes Frame `f` and returns an Error.
#define JAXINFER_FFI_HANDLER(symbol, f)                                                    \
  static ::jaxinfer_ffi::Error symbol##_Body(::jaxinfer_ffi::Frame& f);                   \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* symbol(XLA_FFI_CallFrame* cf) { \
    return ::jaxinfer_ffi::Call<symbol##_Body>(cf);                                       \
  }                                                                                       \
  static ::jaxinfer_ffi::Error symbol##_Body(::jaxinfer_ffi::Frame& f)
