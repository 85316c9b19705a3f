/* CollectivesCall: a TensorFlow op whose kernel runs one of this package's
 * Python bodies on the node's input tensors, without tf.numpy_function's
 * machinery (its function registry, eager-tensor wrapping and per-call
 * bookkeeping: 30-70 us more a node here, docs/training.md).
 *
 * Built at first use against the installed TensorFlow's C API (kernels.h,
 * ops.h: declarations only, so the build takes a second, where TensorFlow's
 * C++ headers take 40; compiled as C++ because ops.h is not valid C) by
 * collectives/tensorflow/native.py, which documents
 * the contract. In short, for a node with attr `body` (an integer key):
 *
 *   dispatch(body, inputs) -> list of C-contiguous NumPy arrays, or
 *                             (code, message) for a failure
 *
 * `dispatch` is native.py's, `inputs` a tuple of (memoryview, dtype enum,
 * shape) per input: read-only views of TensorFlow's buffers, valid until
 * the call returns. Each output array becomes the node's output without a
 * copy (TF_NewTensor; TensorFlow copies one that is not aligned to its
 * liking) and is released, with the GIL, when TensorFlow lets go of it.
 *
 * The kernel takes the GIL for the call (TensorFlow runs graphs without
 * it). The op is stateful: tf.function's automatic control dependencies
 * then chain its nodes in program order, and nothing folds or prunes them.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tensorflow/c/kernels.h"
#include "tensorflow/c/ops.h"
#include "tensorflow/c/tf_datatype.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"

#define OP_NAME "CollectivesCall"
#define DISPATCH_MODULE "collectives.tensorflow.native"

typedef struct {
    int64_t body;
} Kernel;

static void *create_kernel(TF_OpKernelConstruction *ctx)
{
    Kernel *kernel = static_cast<Kernel *>(calloc(1, sizeof *kernel));
    TF_Status *status = TF_NewStatus();
    TF_OpKernelConstruction_GetAttrInt64(ctx, "body", &kernel->body, status);
    if (TF_GetCode(status) != TF_OK) {
        TF_OpKernelConstruction_Failure(ctx, status);
        free(kernel);
        kernel = NULL;
    }
    TF_DeleteStatus(status);
    return kernel;
}

static void delete_kernel(void *kernel)
{
    free(kernel);
}

/* The GIL for this thread. TensorFlow's threads have no Python thread state:
 * PyGILState_Ensure would make one and PyGILState_Release free it at every
 * call, and Python code run on a fresh state costs ~15 us more a call here.
 * So a thread without a state is given one that it keeps (an Ensure never
 * released, the GIL then let go): later Ensures only take the GIL.
 * TensorFlow's threads live as long as the process; so do their states. A
 * thread that has a state (Python's own: a tensor freed by Python code
 * releases its array here, the GIL held) takes the plain Ensure, which
 * nests. */
static PyGILState_STATE take_gil(void)
{
    if (PyGILState_GetThisThreadState() == NULL) {
        PyGILState_Ensure();
        PyEval_SaveThread();
    }
    return PyGILState_Ensure();
}

/* Whether the interpreter is ending: a thread that then takes the GIL is
 * ended where it stands (Python's rule), which would be one of TensorFlow's. */
static int interpreter_ending(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return !Py_IsInitialized() || Py_IsFinalizing();
#else
    return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

/* The output's NumPy array, released once TensorFlow lets go of its buffer
 * (from any thread; while the interpreter ends, left to it). */
static void release_array(void *data, size_t len, void *array)
{
    (void)data;
    (void)len;
    if (interpreter_ending())
        return;
    PyGILState_STATE gil = take_gil();
    Py_DECREF((PyObject *)array);
    PyGILState_Release(gil);
}

static void fail(TF_OpKernelContext *ctx, TF_Code code, const char *message)
{
    TF_Status *status = TF_NewStatus();
    TF_SetStatus(status, code, message);
    TF_OpKernelContext_Failure(ctx, status);
    TF_DeleteStatus(status);
}

/* The Python error now raised, as the node's failure (TF_INTERNAL: dispatch
 * turns our own errors into (code, message) answers; this is anything else). */
static void fail_with_python_error(TF_OpKernelContext *ctx, const char *where)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *text = value != NULL ? PyObject_Str(value) : NULL;
    const char *message = text != NULL ? PyUnicode_AsUTF8(text) : NULL;
    char buffer[2048];
    snprintf(buffer, sizeof buffer, "%s: %s: %s", where,
             type != NULL ? ((PyTypeObject *)type)->tp_name : "error", message != NULL ? message : "(no message)");
    PyErr_Clear();
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    fail(ctx, TF_INTERNAL, buffer);
}

static PyObject *dispatch_function(void)
{
    static PyObject *dispatch;   /* (kept for the process's life) */
    if (dispatch == NULL) {
        PyObject *module = PyImport_ImportModule(DISPATCH_MODULE);
        if (module == NULL)
            return NULL;
        dispatch = PyObject_GetAttrString(module, "dispatch");
        Py_DECREF(module);
    }
    return dispatch;
}

/* (memoryview, dtype enum, shape) of input i; *held is the tensor to delete after the call. */
static PyObject *input_triple(TF_OpKernelContext *ctx, int i, TF_Tensor **held, TF_Status *status)
{
    static char empty[1];
    TF_GetInput(ctx, i, held, status);
    if (TF_GetCode(status) != TF_OK)
        return NULL;
    TF_Tensor *t = *held;
    int dims = TF_NumDims(t);
    PyObject *shape = PyTuple_New(dims);
    if (shape == NULL)
        return NULL;
    for (int d = 0; d < dims; d++)
        PyTuple_SET_ITEM(shape, d, PyLong_FromLongLong(TF_Dim(t, d)));
    size_t nbytes = TF_TensorByteSize(t);
    char *data = nbytes > 0 ? static_cast<char *>(TF_TensorData(t)) : empty;
    PyObject *view = PyMemoryView_FromMemory(data, (Py_ssize_t)nbytes, PyBUF_READ);
    if (view == NULL) {
        Py_DECREF(shape);
        return NULL;
    }
    return Py_BuildValue("(NiN)", view, (int)TF_TensorType(t), shape);
}

/* Output i from `array` (a C-contiguous NumPy array of the output's dtype,
 * as dispatch checked): shares its memory; 0, or -1 with the node failed. */
static int set_output(TF_OpKernelContext *ctx, int i, PyObject *array)
{
    Py_buffer buffer;
    if (PyObject_GetBuffer(array, &buffer, PyBUF_C_CONTIGUOUS | PyBUF_STRIDES) < 0) {
        fail_with_python_error(ctx, OP_NAME " output");
        return -1;
    }
    int64_t dims[64];
    int ndim = buffer.ndim;
    if (ndim > 64) {
        PyBuffer_Release(&buffer);
        fail(ctx, TF_INVALID_ARGUMENT, OP_NAME ": an output of more than 64 dimensions");
        return -1;
    }
    for (int d = 0; d < ndim; d++)
        dims[d] = buffer.shape[d];
    void *data = buffer.buf;
    size_t nbytes = (size_t)buffer.len;
    PyBuffer_Release(&buffer);   /* the array itself keeps the memory: TensorFlow holds the array */
    Py_INCREF(array);
    TF_Tensor *tensor = TF_NewTensor(TF_ExpectedOutputDataType(ctx, i), dims, ndim, data, nbytes,
                                     release_array, array);
    if (tensor == NULL) {   /* (the deallocator already ran) */
        fail(ctx, TF_INTERNAL, OP_NAME ": an output's bytes do not match its dtype and shape");
        return -1;
    }
    TF_Status *status = TF_NewStatus();
    TF_SetOutput(ctx, i, tensor, status);
    int ok = TF_GetCode(status) == TF_OK;
    if (!ok)
        TF_OpKernelContext_Failure(ctx, status);
    TF_DeleteStatus(status);
    /* TF_SetOutput took its own reference to the buffer; deleting this
     * handle releases the array only once TensorFlow is done with it too
     * (which may be now, with the GIL held: PyGILState_Ensure nests) */
    TF_DeleteTensor(tensor);
    return ok ? 0 : -1;
}

static void compute(void *kernel_pointer, TF_OpKernelContext *ctx)
{
    Kernel *kernel = static_cast<Kernel *>(kernel_pointer);
    int ninputs = TF_NumInputs(ctx), noutputs = TF_NumOutputs(ctx);
    TF_Tensor **held = static_cast<TF_Tensor **>(calloc((size_t)(ninputs > 0 ? ninputs : 1), sizeof *held));
    TF_Status *status = TF_NewStatus();
    PyGILState_STATE gil = take_gil();
    PyObject *dispatch = dispatch_function();
    PyObject *inputs = dispatch != NULL ? PyTuple_New(ninputs) : NULL;
    PyObject *answer = NULL;
    if (inputs == NULL) {
        fail_with_python_error(ctx, OP_NAME " setup");
        goto done;
    }
    for (int i = 0; i < ninputs; i++) {
        PyObject *triple = input_triple(ctx, i, &held[i], status);
        if (triple == NULL) {
            if (TF_GetCode(status) != TF_OK)
                TF_OpKernelContext_Failure(ctx, status);
            else
                fail_with_python_error(ctx, OP_NAME " input");
            goto done;
        }
        PyTuple_SET_ITEM(inputs, i, triple);
    }
    answer = PyObject_CallFunction(dispatch, "LO", (long long)kernel->body, inputs);
    if (answer == NULL) {
        fail_with_python_error(ctx, OP_NAME);
        goto done;
    }
    if (PyTuple_Check(answer)) {   /* (code, message): a failure dispatch has described */
        int code;
        const char *message;
        if (!PyArg_ParseTuple(answer, "is", &code, &message))
            fail_with_python_error(ctx, OP_NAME " failure");
        else
            fail(ctx, (TF_Code)code, message);
        goto done;
    }
    if (!PyList_Check(answer) || PyList_GET_SIZE(answer) != noutputs) {
        fail(ctx, TF_INTERNAL, OP_NAME ": dispatch answered something other than the node's outputs");
        goto done;
    }
    for (int i = 0; i < noutputs; i++)
        if (set_output(ctx, i, PyList_GET_ITEM(answer, i)) < 0)
            break;
done:
    /* the views of the inputs go before their tensors (dispatch keeps none) */
    Py_XDECREF(inputs);
    Py_XDECREF(answer);
    PyGILState_Release(gil);
    for (int i = 0; i < ninputs; i++)
        if (held[i] != NULL)
            TF_DeleteTensor(held[i]);
    free(held);
    TF_DeleteStatus(status);
}

static void unknown_shapes(TF_ShapeInferenceContext *ctx, TF_Status *status)
{
    TF_ShapeInferenceContextSetUnknownShape(ctx, status);
}

/* Registered when tf.load_op_library loads this library. */
__attribute__((constructor)) static void register_op(void)
{
    TF_Status *status = TF_NewStatus();
    TF_OpDefinitionBuilder *op = TF_NewOpDefinitionBuilder(OP_NAME);
    TF_OpDefinitionBuilderAddAttr(op, "body: int");
    TF_OpDefinitionBuilderAddAttr(op, "Tin: list(type) >= 0");
    TF_OpDefinitionBuilderAddAttr(op, "Tout: list(type) >= 0");
    TF_OpDefinitionBuilderAddInput(op, "inputs: Tin");
    TF_OpDefinitionBuilderAddOutput(op, "outputs: Tout");
    TF_OpDefinitionBuilderSetIsStateful(op, 1);
    TF_OpDefinitionBuilderSetShapeInferenceFunction(op, unknown_shapes);
    TF_RegisterOpDefinition(op, status);
    if (TF_GetCode(status) == TF_OK) {
        TF_KernelBuilder *builder = TF_NewKernelBuilder(OP_NAME, "CPU", create_kernel, compute, delete_kernel);
        TF_RegisterKernelBuilder(OP_NAME, builder, status);
    }
    if (TF_GetCode(status) != TF_OK)
        fprintf(stderr, "collectives: registering %s failed: %s\n", OP_NAME, TF_Message(status));
    TF_DeleteStatus(status);
}
