/* Socket I/O for the batches, without the GIL (but ``raise_for``): a bounded wait, a
 * vectored send of a whole request, and a batch's error as the exception it raises. */
#include "_pipelines.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>

/* poll() for ``events`` up to ``timeout`` seconds (< 0: no limit): > 0 ready, 0 timed out, -1 error. */
int wait_for(int fd, short events, double timeout) {
    int ms = timeout < 0 ? -1 : (timeout * 1000.0 > INT_MAX ? INT_MAX : (int)(timeout * 1000.0 + 0.999));
    struct pollfd p = {fd, events, 0};
    for (;;) {
        int r = poll(&p, 1, ms);
        if (r >= 0) return r;
        if (errno != EINTR) return -1;
    }
}

/* Send the buffers ``iov[0:n]`` whole (the array is consumed); E_NONE or why not. */
int send_all(int fd, double timeout, struct iovec *iov, Py_ssize_t n, int *err_no) {
    Py_ssize_t k = 0;
    while (k < n && iov[k].iov_len == 0) k++;
    while (k < n) {
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov + k;
        msg.msg_iovlen = (size_t)(n - k < WINDOW ? n - k : WINDOW);
        ssize_t r = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int ready = wait_for(fd, POLLOUT, timeout);
                if (ready > 0) continue;
                *err_no = errno;
                return ready == 0 ? E_TIMEOUT : E_OS;
            }
            *err_no = errno;
            return E_OS;
        }
        while (r > 0) {
            if ((size_t)r >= iov[k].iov_len) {
                r -= (ssize_t)iov[k].iov_len;
                k++;
            } else {
                iov[k].iov_base = (char *)iov[k].iov_base + r;
                iov[k].iov_len -= (size_t)r;
                r = 0;
            }
        }
        while (k < n && iov[k].iov_len == 0) k++;
    }
    return E_NONE;
}

/* Sets the exception for ``error`` (1), or returns 0 for E_NONE. With the GIL. */
int raise_for(int error, int err_no, const char *message) {
    switch (error) {
    case E_PROTOCOL:
        PyErr_SetString(PyExc_ValueError, message ? message : "not RESP");
        return 1;
    case E_TIMEOUT:
        PyErr_SetString(PyExc_TimeoutError, "timed out");
        return 1;
    case E_CLOSED:
        PyErr_SetString(PyExc_ConnectionError, "the server closed the connection");
        return 1;
    case E_OS:
        errno = err_no;
        PyErr_SetFromErrno(PyExc_OSError);
        return 1;
    }
    return 0;
}
