/* The compiled core's index arrays: malloc'd blocks handed to torch (or numpy) as DLPack
   tensors, and a batch eviction's shared, reference-counted block */
#ifndef RC_DLPACK_H
#define RC_DLPACK_H

#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

/* The returned index tensor in one allocation and one copy: a DLPack capsule over a
   malloc'd block (header, then the int64 data) that torch takes over; its deleter frees
   the block when the tensor dies (from any thread: plain malloc/free). */
typedef struct { int32_t device_type; int32_t device_id; } rc_DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } rc_DLDataType;
typedef struct {
    void* data; rc_DLDevice device; int32_t ndim; rc_DLDataType dtype;
    int64_t* shape; int64_t* strides; uint64_t byte_offset;
} rc_DLTensor;
typedef struct rc_DLManagedTensor {
    rc_DLTensor dl_tensor; void* manager_ctx; void (*deleter)(struct rc_DLManagedTensor*);
} rc_DLManagedTensor;
/* refs: only for a batch eviction's shared block (rc_share_block). */
typedef struct {
    rc_DLManagedTensor managed; int64_t shape[1]; int64_t strides[1]; int64_t refs;
} rc_dl_head;

static void rc_dl_deleter(rc_DLManagedTensor* self) { free(self->manager_ctx); }

static void rc_dl_capsule_destructor(PyObject* capsule) {
    /* Still named "dltensor": torch never took it (an error came first). */
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        rc_DLManagedTensor* m = (rc_DLManagedTensor*)PyCapsule_GetPointer(capsule, "dltensor");
        m->deleter(m);
    }
}

/* Fill a managed DLPack tensor: n int64 on the CPU at data, 1-D, contiguous; its
   shape and strides live at shape/strides; deleter(ctx's owner) runs when it dies. */
static void rc_fill_dl(rc_DLManagedTensor* m, int64_t* shape, int64_t* strides,
                       void* data, Py_ssize_t n, void* ctx,
                       void (*deleter)(rc_DLManagedTensor*)) {
    shape[0] = n;
    strides[0] = 1;
    m->dl_tensor.data = data;
    m->dl_tensor.device.device_type = 1;  /* kDLCPU */
    m->dl_tensor.device.device_id = 0;
    m->dl_tensor.ndim = 1;
    m->dl_tensor.dtype.code = 0;          /* kDLInt */
    m->dl_tensor.dtype.bits = 64;
    m->dl_tensor.dtype.lanes = 1;
    m->dl_tensor.shape = shape;
    m->dl_tensor.strides = strides;
    m->dl_tensor.byte_offset = 0;
    m->manager_ctx = ctx;
    m->deleter = deleter;
}

/* The header's size, rounded up: the int64 data of a block starts there. */
#define RC_DL_HEAD (((size_t)sizeof(rc_dl_head) + 63) & ~(size_t)63)

/* A block of the capsule layout (header, then room for n int64), or NULL. */
static char* rc_int64_block(Py_ssize_t n) {
    return (char*)malloc(RC_DL_HEAD + (size_t)(n > 0 ? n : 1) * sizeof(int64_t));
}

/* A capsule over a malloc'd block of the capsule layout holding n int64 after its
   header: the capsule (then torch's tensor) owns the block from here, on failure too. */
static PyObject* rc_adopt_block(char* mem, Py_ssize_t n) {
    rc_dl_head* h = (rc_dl_head*)mem;
    PyObject* capsule;
    rc_fill_dl(&h->managed, h->shape, h->strides, mem + RC_DL_HEAD, n, mem, rc_dl_deleter);
    capsule = PyCapsule_New(&h->managed, "dltensor", rc_dl_capsule_destructor);
    if (capsule == NULL) { free(mem); return NULL; }
    return capsule;
}

/* A batch eviction's block is shared: by the batch while it grows, by tensors over
   part of it (a backup's argument) and in the end by the batch's tensor. Each holds one
   of its refs (atomic: torch may drop a tensor on any thread); the last one frees it.
   The batch grows (reallocs) or reuses it only while it holds the only ref. */
static void rc_block_release(char* mem) {
    if (__atomic_sub_fetch(&((rc_dl_head*)mem)->refs, 1, __ATOMIC_ACQ_REL) == 0)
        free(mem);
}

static int rc_block_alone(char* mem) {
    return __atomic_load_n(&((rc_dl_head*)mem)->refs, __ATOMIC_ACQUIRE) == 1;
}

static void rc_shared_deleter(rc_DLManagedTensor* self) {
    rc_block_release((char*)self->manager_ctx);
}

/* The whole block's tensor capsule over n int64, taking over the caller's ref. */
static PyObject* rc_share_block(char* mem, Py_ssize_t n) {
    rc_dl_head* h = (rc_dl_head*)mem;
    PyObject* capsule;
    rc_fill_dl(&h->managed, h->shape, h->strides, mem + RC_DL_HEAD, n, mem,
               rc_shared_deleter);
    capsule = PyCapsule_New(&h->managed, "dltensor", rc_dl_capsule_destructor);
    if (capsule == NULL) rc_block_release(mem);
    return capsule;
}

typedef struct {
    rc_DLManagedTensor managed; int64_t shape[1]; int64_t strides[1]; char* block;
} rc_dl_view;

static void rc_view_deleter(rc_DLManagedTensor* self) {
    rc_dl_view* v = (rc_dl_view*)self->manager_ctx;
    rc_block_release(v->block);
    free(v);
}

/* A capsule over n int64 of a shared block from offset start, holding a new ref. */
static PyObject* rc_view_block(char* mem, Py_ssize_t start, Py_ssize_t n) {
    rc_dl_view* v = (rc_dl_view*)malloc(sizeof(rc_dl_view));
    PyObject* capsule;
    if (v == NULL) { PyErr_NoMemory(); return NULL; }
    __atomic_add_fetch(&((rc_dl_head*)mem)->refs, 1, __ATOMIC_ACQ_REL);
    v->block = mem;
    rc_fill_dl(&v->managed, v->shape, v->strides, (int64_t*)(mem + RC_DL_HEAD) + start, n,
               v, rc_view_deleter);
    capsule = PyCapsule_New(&v->managed, "dltensor", rc_dl_capsule_destructor);
    if (capsule == NULL) { rc_block_release(mem); free(v); }
    return capsule;
}

static PyObject* rc_int64_capsule(Py_ssize_t n, int64_t** data) {
    char* mem = rc_int64_block(n);
    if (mem == NULL) { PyErr_NoMemory(); return NULL; }
    *data = (int64_t*)(mem + RC_DL_HEAD);
    return rc_adopt_block(mem, n);
}

#endif /* RC_DLPACK_H */
