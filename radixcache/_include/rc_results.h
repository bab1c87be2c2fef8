/* The compiled core's results (MatchResult, InsertResult) made with their __slots__ filled
   directly */
#ifndef RC_RESULTS_H
#define RC_RESULTS_H

#include <Python.h>
#include "structmember.h"

/* The offset of a __slots__ member in its objects, from its member descriptor. */
static Py_ssize_t rc_slot_offset(PyObject* descr) {
    if (Py_TYPE(descr) != &PyMemberDescr_Type) {
        PyErr_SetString(PyExc_TypeError, "not a __slots__ member");
        return -1;
    }
    return ((PyMemberDescrObject*)descr)->d_member->offset;
}

/* A MatchResult with its five slots filled (offsets from rc_slot_offset): no
   attribute lookup, no Python-level __init__. */
static PyObject* rc_make_match(PyObject* type, const Py_ssize_t* offsets,
                               PyObject* indices, PyObject* node, PyObject* length,
                               PyObject* host_length, PyObject* last_host) {
    PyObject* values[5];
    PyObject* obj = ((PyTypeObject*)type)->tp_alloc((PyTypeObject*)type, 0);
    int i;
    if (obj == NULL) return NULL;
    values[0] = indices; values[1] = node; values[2] = length;
    values[3] = host_length; values[4] = last_host;
    for (i = 0; i < 5; i++) {
        PyObject** slot = (PyObject**)((char*)obj + offsets[i]);
        PyObject* old = *slot;
        Py_INCREF(values[i]);
        *slot = values[i];
        Py_XDECREF(old);  /* NULL: tp_alloc zeroes the object */
    }
    return obj;
}

/* An InsertResult with its two slots filled, as rc_make_match does. */
static PyObject* rc_make_insert(PyObject* type, const Py_ssize_t* offsets,
                                PyObject* prefix_len, PyObject* node) {
    PyObject* values[2];
    PyObject* obj = ((PyTypeObject*)type)->tp_alloc((PyTypeObject*)type, 0);
    int i;
    if (obj == NULL) return NULL;
    values[0] = prefix_len; values[1] = node;
    for (i = 0; i < 2; i++) {
        PyObject** slot = (PyObject**)((char*)obj + offsets[i]);
        PyObject* old = *slot;
        Py_INCREF(values[i]);
        *slot = values[i];
        Py_XDECREF(old);
    }
    return obj;
}

#endif /* RC_RESULTS_H */
