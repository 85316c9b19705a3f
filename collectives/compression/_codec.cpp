// The compression codecs' CPU loops: kernels/codec.cuh's arithmetic over
// blocks of 32 elements, for host ranks. A Python extension (setup.py builds
// it, optional like _shmloop); collectives/compression/kernels.py validates
// the arrays and passes their addresses.
//
// Speed: host ranks pay for these loops on every hop of a compressed
// allreduce, so they must run near memory speed (bench/codec_speed.py).
// Each pass over a block (its largest |v|, then each value's encoding) is a
// loop of 32 steps with selects, no branches, that the compiler vectorizes;
// what is rare (inf or NaN in a block, unusual float16 payloads) is decided
// per block. Every case that pays is its own instance (in place or not, a
// divisor or not, whole blocks of 32 or the partial last one), so that each
// loop is straight-line code over known pointers.
//
// A block's operation reads its float32 values v (x; acc + decode(b);
// acc + b) in up to two passes: the largest |v|, for the scale, then each
// value's encoding. The second pass computes v again, in the same float32
// steps, so it has the same bits; out may be acc (or b, for add), and with
// write_out false out is never written.
//
// Built with -O3 -ffp-contract=off: no FMA contraction, so every float32 step
// rounds as on the GPU and in the NumPy reference.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_codec_loops_table.h"

namespace {

using namespace collectives::codec;
using collectives_codec::Loops;

// The loops, compiled here for the baseline instruction set and, on x86-64
// with GCC, in units of their own for AVX2 and AVX-512 (_codec_avx2.cpp,
// _codec_avx512.cpp: wider vectors, the same bits); the module picks the
// widest the CPU has when it loads (loops).
namespace baseline {
#include "_codec_loops.h"
}  // namespace baseline

Loops choose_loops() {
#ifdef COLLECTIVES_CODEC_MULTIVERSION
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return collectives_codec::avx512_loops();
    if (__builtin_cpu_supports("avx2")) return collectives_codec::avx2_loops();
#endif
    return COLLECTIVES_LOOPS(baseline);
}

const Loops loops = choose_loops();

// -- Python: addresses and sizes in, checked by kernels.py ------------------------

PyObject* py_encode(PyObject*, PyObject* args) {
    int codec, round_x;
    unsigned long long x, payload, scales;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iKKKnp", &codec, &x, &payload, &scales, &n, &round_x)) return nullptr;
    Py_BEGIN_ALLOW_THREADS
    loops.encode(codec, x, payload, scales, static_cast<std::size_t>(n), round_x);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_decode(PyObject*, PyObject* args) {
    int codec;
    unsigned long long payload, scales, out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iKKKn", &codec, &payload, &scales, &out, &n)) return nullptr;
    Py_BEGIN_ALLOW_THREADS
    loops.decode(codec, payload, scales, out, static_cast<std::size_t>(n));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_decode_add(PyObject*, PyObject* args) {
    int codec, encode, write;
    unsigned long long acc, payload, scales, out, out_payload, out_scales;
    Py_ssize_t n;
    float divisor;
    if (!PyArg_ParseTuple(args, "iKKKKnfKKpp", &codec, &acc, &payload, &scales, &out, &n, &divisor, &out_payload,
                          &out_scales, &encode, &write))
        return nullptr;
    Py_BEGIN_ALLOW_THREADS
    loops.decode_add(codec, acc, payload, scales, out, static_cast<std::size_t>(n), divisor, out_payload, out_scales,
                     encode, write);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_add(PyObject*, PyObject* args) {
    int codec, encode, write;
    unsigned long long acc, b, out, out_payload, out_scales;
    Py_ssize_t n;
    float divisor;
    if (!PyArg_ParseTuple(args, "iKKKnfKKpp", &codec, &acc, &b, &out, &n, &divisor, &out_payload, &out_scales,
                          &encode, &write))
        return nullptr;
    Py_BEGIN_ALLOW_THREADS
    loops.add(codec, acc, b, out, static_cast<std::size_t>(n), divisor, out_payload, out_scales, encode, write);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// The per-element conversions alone, over arrays, for the tests that compare
// them with NumPy on every float16 and a sweep of float32 values.
PyObject* py_convert(PyObject*, PyObject* args) {
    unsigned long long x, f16, f16_value, bf16, payload, general, plain;
    Py_ssize_t n, m;
    if (!PyArg_ParseTuple(args, "KKKKnKKKn", &x, &f16, &f16_value, &bf16, &n, &payload, &general, &plain, &m))
        return nullptr;
    const float* xs = reinterpret_cast<const float*>(x);
    for (Py_ssize_t i = 0; i < n; ++i) {
        float value;
        reinterpret_cast<std::uint16_t*>(f16)[i] = static_cast<std::uint16_t>(to_f16(xs[i], &value));
        reinterpret_cast<float*>(f16_value)[i] = value;
        reinterpret_cast<std::uint16_t*>(bf16)[i] = static_cast<std::uint16_t>(to_bf16(xs[i]));
    }
    const std::uint16_t* ps = reinterpret_cast<const std::uint16_t*>(payload);
    for (Py_ssize_t i = 0; i < m; ++i) {
        reinterpret_cast<float*>(general)[i] = from_f16(ps[i]);
        reinterpret_cast<float*>(plain)[i] = from_plain_f16(ps[i]);
    }
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS, "encode(codec, x, payload, scales, n, round_x)"},
    {"decode", py_decode, METH_VARARGS, "decode(codec, payload, scales, out, n)"},
    {"decode_add", py_decode_add, METH_VARARGS,
     "decode_add(codec, acc, payload, scales, out, n, divisor, out_payload, out_scales, encode_out, write_out)"},
    {"add", py_add, METH_VARARGS,
     "add(codec, acc, b, out, n, divisor, out_payload, out_scales, encode_out, write_out)"},
    {"convert", py_convert, METH_VARARGS,
     "convert(x, f16, f16_value, bf16, n, payload, general, plain, m): the conversions alone (tests)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codec",
                      "The compression codecs' CPU loops (kernels/codec.cuh); addresses in, see kernels.py.", -1,
                      methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__codec(void) {
    PyObject* m = PyModule_Create(&module);
    if (m != nullptr && (PyModule_AddIntConstant(m, "BLOCK", kBlock) < 0 ||
                         PyModule_AddStringConstant(m, "TARGET", loops.target) < 0)) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
