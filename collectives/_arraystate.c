/* What a repeated call reads back of NumPy arrays it has seen
 * (collectives/arrays.py, repeat_state; Communicator._collective), read from
 * the array struct instead of through Python attributes.
 *
 * A repeated call with the very arrays of an earlier call that passed every
 * check takes that call's verdict, as long as every fact the checks depend on
 * still holds: shape, dtype, flags (writeable, contiguous) and, for safety's
 * sake, the data address. Through Python, `a.shape`, `a.dtype` and
 * `a.flags.num` build a tuple and a flags object per array: about 2,000
 * instructions an array, 16,000 of the 40,000 of a 4-rank out-of-place
 * allreduce. Here the same facts of all the call's arrays go into one bytes
 * object, compared with the remembered one by the caller: about 1,300
 * instructions for 8 arrays.
 *
 * numpy_states(arrays) -> bytes, `arrays` a tuple of NumPy arrays: per array
 * its data address, its dtype (the descriptor's address: an array retyped in
 * place gets another), its flags, its number of dimensions and each
 * dimension, as C integers of the pointer's size. Two calls give equal bytes
 * only if every array has the same values of all of them. The dtype is
 * compared by address without a reference here: the remembered call's
 * ArrayInfos hold its dtype objects, so no other dtype can take that address
 * while the call is remembered.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

static PyObject* numpy_states(PyObject* module, PyObject* arrays) {
    (void)module;
    if (!PyTuple_CheckExact(arrays)) {
        PyErr_SetString(PyExc_TypeError, "numpy_states takes a tuple of NumPy arrays");
        return NULL;
    }
    const Py_ssize_t n = PyTuple_GET_SIZE(arrays);
    Py_ssize_t words = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject* a = PyTuple_GET_ITEM(arrays, i);
        if (!PyArray_Check(a)) {
            PyErr_Format(PyExc_TypeError, "numpy_states takes NumPy arrays, got %.100s", Py_TYPE(a)->tp_name);
            return NULL;
        }
        words += 4 + PyArray_NDIM((PyArrayObject*)a);
    }
    PyObject* states = PyBytes_FromStringAndSize(NULL, words * (Py_ssize_t)sizeof(npy_intp));
    if (states == NULL) {
        return NULL;
    }
    npy_intp* word = (npy_intp*)PyBytes_AS_STRING(states);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyArrayObject* a = (PyArrayObject*)PyTuple_GET_ITEM(arrays, i);
        const int ndim = PyArray_NDIM(a);
        const npy_intp* shape = PyArray_DIMS(a);
        *word++ = (npy_intp)PyArray_DATA(a);
        *word++ = (npy_intp)PyArray_DESCR(a);
        *word++ = PyArray_FLAGS(a);
        *word++ = ndim;
        for (int d = 0; d < ndim; d++) {
            *word++ = shape[d];
        }
    }
    return states;
}

static PyMethodDef module_methods[] = {
    {"numpy_states", numpy_states, METH_O,
     "numpy_states(arrays): the state a repeated call compares of a tuple of NumPy arrays, as bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "_arraystate",
    "What a repeated call reads back of NumPy arrays, from the array struct (see the source's header).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__arraystate(void) {
    /* NumPy's C API. Where this NumPy cannot serve the one it was built
     * against, an ImportError, which arrays.py takes quietly (import_array()
     * would print it first). */
    if (_import_array() < 0) {
        return NULL;
    }
    return PyModule_Create(&module_definition);
}
