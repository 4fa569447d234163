/* The pod sandbox's only process (what Kubernetes calls the "pause" container): it holds
 * the pod's namespaces, reaps any orphan re-parented to it, and exits on SIGTERM or SIGINT.
 * Built static by tests/tools/install-node.sh into the local image nightshift-pause, which
 * the test node's containerd uses as its sandbox image (no registry is reachable here). */
#include <signal.h>
#include <stddef.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction on_stop = {.sa_handler = stop};
    struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    sigaction(SIGTERM, &on_stop, NULL);
    sigaction(SIGINT, &on_stop, NULL);
    sigaction(SIGCHLD, &on_child, NULL);
    for (;;) {
        pause();
    }
}
