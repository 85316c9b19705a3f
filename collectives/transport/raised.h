/* The exception a C call of Python raised, taken out of the thread's error
 * indicator so that C can hand it to Python code (a failure handler that
 * aborts the communicator, then raises it again). Shared by the compiled
 * loop's shortcuts (_shmloop.c), the Programs' (_across.c) and the plans'
 * repeats (_host_plan.c); the including file includes Python.h first. */

#ifndef COLLECTIVES_RAISED_H
#define COLLECTIVES_RAISED_H

/* A new reference to the raised exception, its traceback attached; NULL
 * where none is set. The error indicator is clear afterwards. */
static inline PyObject *take_raised(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL)
        PyException_SetTraceback(value, traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value;
#endif
}

#endif
