/* A torch.Tensor's facts read through torch's own C accessors (see _core_c.pyx) */
#ifndef RC_TENSOR_H
#define RC_TENSOR_H

#include <Python.h>

typedef PyObject* (*rc_fast_meth)(PyObject*, PyObject* const*, Py_ssize_t);
typedef PyObject* (*rc_fast_kw_meth)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*);
typedef struct {
    getter get;          /* a getset descriptor's getter, or NULL */
    void* closure;
    PyCFunction meth;    /* else a method descriptor's function */
    int flags;           /* its calling convention */
} rc_accessor;

static PyObject* rc_no_args = NULL;

/* Bind ``a`` to the C function behind ``descr``: 1, or 0 when it is neither a getset
   descriptor with a getter nor a method descriptor of a convention handled here. */
static int rc_accessor_bind(rc_accessor* a, PyObject* descr) {
    a->get = NULL; a->closure = NULL; a->meth = NULL; a->flags = 0;
    if (Py_IS_TYPE(descr, &PyGetSetDescr_Type)) {
        PyGetSetDef* def = ((PyGetSetDescrObject*)descr)->d_getset;
        if (def == NULL || def->get == NULL) return 0;
        a->get = def->get;
        a->closure = def->closure;
        return 1;
    }
    if (Py_IS_TYPE(descr, &PyMethodDescr_Type)) {
        PyMethodDef* def = ((PyMethodDescrObject*)descr)->d_method;
        int flags = def->ml_flags & ~METH_COEXIST;
        if (flags != METH_NOARGS && flags != METH_VARARGS
                && flags != (METH_VARARGS | METH_KEYWORDS) && flags != METH_FASTCALL
                && flags != (METH_FASTCALL | METH_KEYWORDS))
            return 0;
        if (rc_no_args == NULL && (rc_no_args = PyTuple_New(0)) == NULL) return -1;
        a->meth = def->ml_meth;
        a->flags = flags;
        return 1;
    }
    return 0;
}

/* The attribute (a getter) or the result of calling the method without arguments, for
   an object of the type the accessor was bound from; NULL with an exception set. */
static PyObject* rc_accessor_read(const rc_accessor* a, PyObject* obj) {
    if (a->get != NULL) return a->get(obj, a->closure);
    switch (a->flags) {
    case METH_NOARGS:
        return a->meth(obj, NULL);
    case METH_VARARGS:
        return a->meth(obj, rc_no_args);
    case METH_VARARGS | METH_KEYWORDS:
        return ((PyCFunctionWithKeywords)(void (*)(void))a->meth)(obj, rc_no_args, NULL);
    case METH_FASTCALL:
        return ((rc_fast_meth)(void (*)(void))a->meth)(obj, NULL, 0);
    case METH_FASTCALL | METH_KEYWORDS:
        return ((rc_fast_kw_meth)(void (*)(void))a->meth)(obj, NULL, 0, NULL);
    }
    PyErr_SetString(PyExc_SystemError, "a tensor accessor is not bound");
    return NULL;
}

#endif /* RC_TENSOR_H */
