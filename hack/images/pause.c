/* The pod sandbox's process for the test node's images (hack/images.sh): holds the
 * pod's namespaces, reaps zombies, exits 0 on SIGINT/SIGTERM. Built static. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, 0, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction a = {0};
  a.sa_handler = quit;
  sigaction(SIGINT, &a, 0);
  sigaction(SIGTERM, &a, 0);
  a.sa_handler = reap;
  a.sa_flags = SA_NOCLDSTOP;
  sigaction(SIGCHLD, &a, 0);
  for (;;) pause();
}
