/* libzmq's receive calls on a socket pyzmq made, bound at run time to the very library
   that made it: the block module reads a subscriber's stream of three-frame messages in one
   call (recv_stream), where pyzmq costs a Python call per frame and an option lookup per
   RCVMORE check (about 2 us each, most of a small batch's ingest).

   The library is found from the socket itself: a libzmq socket is a C++ object whose first
   word points into its library's vtables, so dladdr() names the file that made it, and
   dlopen(RTLD_NOLOAD) of that file returns the copy already loaded (never a second one).
   Where any step fails (no dladdr, a libzmq linked into pyzmq without its symbols exported,
   another platform), rc_zmq_bind() answers 0 and the caller reads through pyzmq. */
#ifndef RC_ZMQ_H
#define RC_ZMQ_H

#include <errno.h>
#include <stddef.h>

#if defined(__linux__) || defined(__APPLE__) || defined(__FreeBSD__)
#include <dlfcn.h>
#define RC_ZMQ_DL 1
#endif

#define RC_ZMQ_DONTWAIT 1 /* ZMQ_DONTWAIT, fixed by libzmq's ABI */

/* zmq_msg_t: 64 bytes, pointer-aligned (libzmq's own declaration). */
typedef struct {
    union {
        unsigned char bytes[64];
        void *align_p;
        double align_d;
    } u;
} rc_zmq_msg;

typedef struct {
    int (*msg_init)(rc_zmq_msg *);
    int (*msg_recv)(rc_zmq_msg *, void *, int);
    int (*msg_close)(rc_zmq_msg *);
    void *(*msg_data)(rc_zmq_msg *);
    size_t (*msg_size)(const rc_zmq_msg *);
    int (*msg_more)(const rc_zmq_msg *);
    int (*errno_)(void);
} rc_zmq_api;

static rc_zmq_api rc_zmq;
/* 0: not tried yet, 1: bound, -1: not available in this process */
static int rc_zmq_state = 0;

/* Bind the calls to the library that made the socket at handle (a live libzmq socket, as
   pyzmq's Socket.underlying gives it); once per process. 1 when bound. */
static int rc_zmq_bind(void *handle) {
#ifdef RC_ZMQ_DL
    Dl_info made, found;
    void *lib;
    void *syms[7];
    static const char *const names[7] = {"zmq_msg_init", "zmq_msg_recv", "zmq_msg_close",
                                         "zmq_msg_data", "zmq_msg_size", "zmq_msg_more",
                                         "zmq_errno"};
    int k;
    if (rc_zmq_state)
        return rc_zmq_state > 0;
    rc_zmq_state = -1;
    if (handle == NULL || !dladdr(*(void *const *)handle, &made) || made.dli_fname == NULL)
        return 0;
    lib = dlopen(made.dli_fname, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib == NULL)
        return 0;
    for (k = 0; k < 7; k++) {
        syms[k] = dlsym(lib, names[k]);
        /* the symbol from that very file, not from one it depends on */
        if (syms[k] == NULL || !dladdr(syms[k], &found) || found.dli_fbase != made.dli_fbase) {
            dlclose(lib);
            return 0;
        }
    }
    /* lib stays open: pyzmq keeps the library loaded for the process's life anyway */
    *(void **)&rc_zmq.msg_init = syms[0];
    *(void **)&rc_zmq.msg_recv = syms[1];
    *(void **)&rc_zmq.msg_close = syms[2];
    *(void **)&rc_zmq.msg_data = syms[3];
    *(void **)&rc_zmq.msg_size = syms[4];
    *(void **)&rc_zmq.msg_more = syms[5];
    *(void **)&rc_zmq.errno_ = syms[6];
    rc_zmq_state = 1;
    return 1;
#else
    (void)handle;
    rc_zmq_state = -1;
    return 0;
#endif
}

/* One frame into msg (initialised here), without waiting: 0, or libzmq's errno (EAGAIN:
   nothing has arrived; never EINTR). On an error msg is closed already. */
static int rc_zmq_recv_frame(void *handle, rc_zmq_msg *msg) {
    int err;
    rc_zmq.msg_init(msg);
    /* EINTR (a signal while libzmq polls its command pipe) is asked again, as pyzmq does: it
       may come between a message's frames, and a message must not be left read in part */
    do {
        if (rc_zmq.msg_recv(msg, handle, RC_ZMQ_DONTWAIT) >= 0)
            return 0;
        err = rc_zmq.errno_();
    } while (err == EINTR);
    rc_zmq.msg_close(msg);
    return err ? err : -1;
}

static void *rc_zmq_data(rc_zmq_msg *msg) { return rc_zmq.msg_data(msg); }
static size_t rc_zmq_size(rc_zmq_msg *msg) { return rc_zmq.msg_size(msg); }
static int rc_zmq_more(rc_zmq_msg *msg) { return rc_zmq.msg_more(msg); }
static void rc_zmq_close(rc_zmq_msg *msg) { rc_zmq.msg_close(msg); }

#endif /* RC_ZMQ_H */
